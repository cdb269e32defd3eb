"""Write grpotrl/data/quickstart.jsonl: small-integer arithmetic with a checkable answer.

    python scripts/make_quickstart_data.py            # rewrites the file; same bytes every run

Each row: ``prompt`` (one user message), ``answer`` (the number as a string), ``completion``
(one assistant message holding just that number, for SFT) and ``split`` ("train" or "test").
The tasks are easy on purpose: SmolLM2-135M-Instruct gets some right before training, so
GRPO's groups hold both rewards 0 and 1 and have a signal to learn from.
"""

import json
import random
from pathlib import Path

N_TRAIN, N_TEST = 200, 40
OUT = Path(__file__).resolve().parent.parent / "grpotrl" / "data" / "quickstart.jsonl"


def make_row(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? Answer with just the number.", str(a + b)
    a, b = max(a, b), min(a, b)  # no negative answers
    return f"What is {a} - {b}? Answer with just the number.", str(a - b)


def main():
    rng = random.Random(0)
    seen, rows = set(), []
    while len(rows) < N_TRAIN + N_TEST:
        question, answer = make_row(rng)
        if question in seen:  # no question in both splits
            continue
        seen.add(question)
        rows.append({
            "prompt": [{"role": "user", "content": question}],
            "answer": answer,
            "completion": [{"role": "assistant", "content": answer}],
            "split": "train" if len(rows) < N_TRAIN else "test",
        })
    with open(OUT, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows ({N_TRAIN} train, {N_TEST} test) to {OUT}")


if __name__ == "__main__":
    main()
