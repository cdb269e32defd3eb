"""Write grpotrl/data/gad_toy.jsonl: the quickstart's train questions with a teacher response.

    python scripts/make_gad_toy_data.py            # rewrites the file; same bytes every run

Each row: ``prompt`` (one user message), ``answer`` (the number as a string),
``teacher_response`` (the answer followed by the fixed closing phrase "Hope this helps!",
a trait easy to check in the student's text) and ``completion`` (the teacher response as one
assistant message, so the same file serves the optional SFT warmup on teacher responses).
"""

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "grpotrl" / "data"
CLOSING = "Hope this helps!"


def teacher_response(answer: str) -> str:
    return f"{answer}. {CLOSING}"


def main():
    rows = []
    with open(DATA / "quickstart.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["split"] != "train":
                continue
            text = teacher_response(row["answer"])
            rows.append({"prompt": row["prompt"], "answer": row["answer"], "teacher_response": text,
                         "completion": [{"role": "assistant", "content": text}]})
    out = DATA / "gad_toy.jsonl"
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
