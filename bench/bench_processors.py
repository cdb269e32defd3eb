"""Cost of grpotrl's logits processors: generation time with all of them on vs off.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_processors.py     # SmolLM2, 8 rows x 64 tokens, 3 rounds
    .venv/bin/python bench/bench_processors.py --rows 16 --tokens 128 --rounds 5

One process, one model (SmolLM2-135M-Instruct), the same 8 left-padded quickstart prompts
and sampling settings (T=0.9, like the recipes); the variants alternate within every round
(off, on, on + record, off, ...) so machine noise hits all of them. "on" is
``build_processors`` with presence 0.5, frequency 0.5, repetition 1.1 and min_new_tokens 8
over the model's stop ids; "on + record" also records the sampler's logprobs as generation
goes (``SampledLogprobRecorder`` inside ``inject_recorders_after_warpers``), the extra work the HF path does
to log the sampler/trainer gap. Stopping on eos is turned off so every variant
generates exactly rows x tokens tokens and the times compare per token; the processors still
block the stop ids for the first 8 tokens. Two generate times on a shared machine are noisy,
so it also times the processors alone on tensors of generate's shapes. Goal: on / off <= 1.05.
Memory is bench_memory.py's; printed here: what ``output_scores`` would hold (C tensors of
[B, V] fp32), which grpotrl no longer asks for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpotrl.data import load_quickstart
    from grpotrl.models import resolve_model_path
    from grpotrl.generation.processors import build_processors
    from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder
    from grpotrl.trainers._intercept import inject_recorders_after_warpers
    from grpotrl.chat.templates import stop_token_ids

    path = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stops = stop_token_ids(tok, model.generation_config)
    model.generation_config.eos_token_id = None  # fixed length: every variant makes rows x tokens tokens
    data = load_quickstart("train")
    texts = [tok.apply_chat_template(data[i % len(data)]["prompt"], add_generation_prompt=True, tokenize=False)
             for i in range(a.rows)]
    batch = tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    P = batch["input_ids"].size(1)

    def generate(variant: str) -> float:
        kw = {}
        if variant != "off":
            kw["logits_processor"] = build_processors(P, presence_penalty=0.5, frequency_penalty=0.5,
                                                      repetition_penalty=1.1, min_new_tokens=8, stop_ids=stops)
        if variant == "on + record":
            kw["logits_processor"].append(SampledLogprobRecorder())
        torch.manual_seed(0)
        t = time.perf_counter()
        with torch.no_grad(), inject_recorders_after_warpers(model):
            seq = model.generate(**batch, do_sample=True, temperature=0.9, top_k=0, top_p=1.0,
                                 max_new_tokens=a.tokens, pad_token_id=tok.pad_token_id, **kw)
            if variant == "on + record":
                kw["logits_processor"][-1].logprobs(seq)
        elapsed = time.perf_counter() - t
        assert seq.size(1) == P + a.tokens, seq.shape
        return elapsed

    variants = ("off", "on", "on + record")
    generate("off")  # warm-up
    times = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants:
            times[v].append(generate(v))
        print(f"round {r}  " + "  ".join(f"{v} {times[v][-1]:.2f} s" for v in variants), flush=True)

    # the processors alone on tensors of generate's shapes, mid-generation (G = tokens / 2): less noisy
    # than the difference of two generate times on a shared machine
    G = a.tokens // 2
    ids = torch.cat([batch["input_ids"], torch.randint(0, model.config.vocab_size, (a.rows, G))], dim=1)  # [B, P+G]
    scores = torch.randn(a.rows, model.config.vocab_size)  # [B, V]
    procs = build_processors(P, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                             min_new_tokens=G + 1, stop_ids=stops)  # min-new-tokens still blocking: its dearer branch
    reps = 200
    t = time.perf_counter()
    for _ in range(reps):
        procs(ids, scores)
    proc_ms = 1000 * (time.perf_counter() - t) / reps

    med = {v: statistics.median(times[v]) for v in variants}
    n = a.rows * a.tokens
    print(f"\nrows={a.rows} tokens={a.tokens} rounds={a.rounds} P={P} V={model.config.vocab_size} "
          f"threads={torch.get_num_threads()}")
    for v in variants:  # paired: each round's time over the same round's "off", median over rounds
        paired = statistics.median(x / o for x, o in zip(times[v], times["off"]))
        print(f"{v:12s} median {med[v]:.2f} s  {1000 * med[v] / n:.2f} ms/token  ratio {med[v] / med['off']:.3f}"
              f"  paired ratio {paired:.3f}")
    step_ms = 1000 * med["off"] / a.tokens
    print(f"processors alone: {proc_ms:.3f} ms per step (B={a.rows}, G={G}) vs {step_ms:.1f} ms per generate step "
          f"off: {proc_ms / step_ms:.4f} of a step")
    print("goal: on / off <= 1.05")
    mib = a.rows * a.tokens * model.config.vocab_size * 4 / 2**20
    print(f"output_scores would hold {a.tokens} x [{a.rows}, {model.config.vocab_size}] fp32 = {mib:.0f} MiB "
          "(grpotrl no longer asks for it)")


if __name__ == "__main__":
    main()
