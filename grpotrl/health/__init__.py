"""Training-health signals: pure functions on the tensors a GRPO step already has.

These are the numbers a user reads by hand in the first steps of a broken run (entropy
0.000, max prob 99.9 %, logit gap 7-10, 36 end-of-turn tokens, 1-token answers, rewards all
zero, a response that starts with the chat header). ``grpotrl.GRPOTrainer`` logs them every
step through TRL's metrics (so they reach TensorBoard / trackio / W&B like TRL's own);
``grpotrl.health.callbacks`` turns them into warnings or a stop. Nothing here runs a model.

Letters: B rows (completions), G completions per prompt, P padded prompt width, C padded
completion width, V vocabulary, K top-k.

What TRL already logs and is reused rather than recomputed: the token-mean ``entropy``,
``completions/mean_length|min_length|max_length``, ``completions/clipped_ratio``,
``frac_reward_zero_std`` (the share of zero-variance groups), ``reward``, ``kl`` and the clip
ratios. The chat-header test and the boundary report a person reads live in ``grpotrl.boundary``.
"""

from __future__ import annotations

import math

import torch

from ..chat.boundary import starts_with_header
from ..ops.logprobs import row_chunks
from ..ops.masking import completion_mask

# ---------------------------------------------------------------- per-token and per-sample entropy


def per_sample_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over each row's masked-in tokens; NaN for a row with no such token.

    >>> per_sample_mean(torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    tensor([2., nan])
    """
    mask = mask.to(x.dtype)  # [B, C]
    n = mask.sum(-1)  # [B]
    return (x * mask).sum(-1) / n.masked_fill(n == 0, float("nan"))  # [B]


def summarise_samples(per_sample: torch.Tensor) -> dict[str, float]:
    """min / p10 / mean of per-sample entropies [B] (``per_sample_mean`` over the completion mask;
    NaN rows dropped; NaN when none is left). TRL logs the token mean; a few collapsed samples hide
    in it. ``min`` and ``p10`` (the 10th percentile, linear interpolation) show them.

    >>> H = torch.tensor([[0.0, 0.0, 9.0], [1.0, 3.0, 0.0], [4.0, 4.0, 4.0]])  # [B=3, C=3]
    >>> m = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])  # per-sample means 0, 2, 4
    >>> summarise_samples(per_sample_mean(H, m))  # p10 = 0 + 0.1 * (3 - 1) * (2 - 0)
    {'entropy/sample_min': 0.0, 'entropy/sample_p10': 0.4000000059604645, 'entropy/sample_mean': 2.0}
    """
    return dict(zip(SAMPLE_SUMMARY, sample_summary(per_sample).tolist()))


SAMPLE_SUMMARY = ("entropy/sample_min", "entropy/sample_p10", "entropy/sample_mean")


def sample_summary(per_sample: torch.Tensor) -> torch.Tensor:
    """``summarise_samples``' values as one tensor [3] (min, p10, mean of the rows that are not NaN; NaN each where
    none is), computed on the device with no host sync: the caller reads it with whatever else it reads.

    >>> sample_summary(torch.tensor([float("nan"), 1.0, 3.0])).tolist()  # p10 = 1 + 0.1 * (2 - 1) * (3 - 1)
    [1.0, 1.2000000476837158, 2.0]
    >>> sample_summary(torch.tensor([float("nan")])).isnan().all().item()
    True
    """
    x = per_sample.float()  # [B]
    nan = torch.isnan(x)  # [B]
    lowest = torch.where(nan, math.inf, x).amin() if x.numel() else x.new_tensor(math.inf)
    lowest = torch.where(nan.all(), math.nan, lowest)  # no row left: NaN, not inf
    return torch.stack([lowest, torch.nanquantile(x, 0.1), torch.nanmean(x)])  # [3]


# ---------------------------------------------------------------- logits: max, top-1 gap, top-5 mass


def logit_stats(logits: torch.Tensor, temperature: float = 1.0, k: int = 5) -> dict[str, torch.Tensor]:
    """Per-token statistics of the completion logits, each [B, C]:

    * ``logits/max``: the largest raw logit (SmolLM2-sized models: 20-25 healthy, 30+ collapsed);
    * ``logits/top1_top2_gap``: largest minus second-largest raw logit (3-5 healthy, 7-10 collapsed);
    * ``logits/top1_prob`` and ``logits/top{k}_mass``: probability of the top token and total
      probability of the top ``k`` under ``softmax(logits / T)``, the distribution that sampled.

    Raw logits are reported unscaled (divide by T for the sampled distribution); the
    probabilities are at the sampling temperature. The fp32 normaliser is taken in ``row_chunks``.

    >>> logits = torch.tensor([[[4.0, 2.0, 1.0, 0.0, 0.0, 0.0, -1.0]]])  # [B=1, C=1, V=7]
    >>> s = logit_stats(logits)
    >>> s["logits/max"].item(), s["logits/top1_top2_gap"].item()
    (4.0, 2.0)
    >>> # top-5 mass = (e^4 + e^2 + e^1 + e^0 + e^0) / (that + e^0 + e^-1) = 66.705 / 68.073
    >>> round(s["logits/top5_mass"].item(), 4)
    0.9799
    """
    logits = logits.detach()  # [B, C, V]
    top = logits.topk(min(k, logits.size(-1)), dim=-1).values.float()  # [B, C, K]
    log_z = torch.cat([torch.logsumexp(logits[rows].float() / temperature, dim=-1, keepdim=True)
                       for rows in row_chunks(logits)]) if logits.size(0) else top[..., :1]  # [B, C, 1]
    top_probs = (top / temperature - log_z).exp()  # [B, C, K]
    gap = top[..., 0] - top[..., 1] if top.size(-1) > 1 else torch.full_like(top[..., 0], math.inf)  # [B, C]
    return {
        "logits/max": top[..., 0],
        "logits/top1_top2_gap": gap,
        "logits/top1_prob": top_probs[..., 0],
        f"logits/top{k}_mass": top_probs.sum(-1),
    }


def logit_signal_sums(logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logit_stats`` summed over the completion mask: [len(LOGIT_SIGNALS), 2] rows of (sum, count),
    summable across processes (``means_of_sums`` turns the total into the logged means)."""
    return torch.stack(list(masked_means(logit_stats(logits, temperature), mask).values()))


LOGIT_SIGNALS = ("logits/max", "logits/top1_top2_gap", "logits/top1_prob", "logits/top5_mass")


def means_of_sums(names, totals: torch.Tensor) -> dict[str, float]:
    """``{name: sum / count}`` from [K, 2] (sum, count) rows; NaN for a count of 0.

    >>> means_of_sums(["a", "b"], torch.tensor([[3.0, 2.0], [1.0, 0.0]]))
    {'a': 1.5, 'b': nan}
    """
    return {name: total / count if count else float("nan") for name, (total, count) in zip(names, totals.tolist())}


def masked_means(per_token: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token means over the completion mask, as ``[sum, count]`` pairs (summable across processes).

    >>> masked_means({"a": torch.tensor([[1.0, 5.0], [3.0, 7.0]])}, torch.tensor([[1, 0], [1, 1]]))
    {'a': tensor([11.,  3.])}
    """
    mask = mask.float()  # [B, C]
    return {name: torch.stack([(x.float() * mask).sum(), mask.sum()]) for name, x in per_token.items()}


# ---------------------------------------------------------------- stop tokens, lengths, headers


def count_ids(ids: torch.Tensor, mask: torch.Tensor, id_set: list[int]) -> torch.Tensor:
    """How many of each row's masked-in tokens are in ``id_set``, [B].

    Count stop tokens in prompts with the prompt mask (left padding is left out, even when the
    pad token is itself a stop token: "50+ end-of-turn tokens in the prompt" counted over the mask was padding) and in
    completions with the completion mask (the tokens the loss trains on).

    >>> ids = torch.tensor([[2, 2, 5, 2, 7, 2], [5, 2, 6, 6, 2, 9]])  # pad == 2 == a stop id
    >>> count_ids(ids, torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]), [0, 2])
    tensor([2, 2])
    """
    hit = torch.isin(ids, torch.as_tensor(list(id_set), device=ids.device, dtype=ids.dtype))  # [B, L]
    return (hit & mask.bool()).sum(-1)  # [B]


def generated_stop_counts(raw: torch.Tensor, stop_ids: list[int], sampler_stop_ids: list[int] | None) -> torch.Tensor:
    """Stop tokens the model really generated in each row of ``generate``'s raw output after the
    prompt, [B, C] -> [B]: every token in ``stop_ids`` up to and including the first token of the
    sampler's own stop set (``sampler_stop_ids``; after it ``generate`` writes padding), so a
    sampler that kept going past an end-of-turn token it did not stop on shows every one of them
    (10+ end-of-turn tokens in one response), where the loss's completion, cut at the first
    stop, holds one. A healthy batch reads 1 for a row that stopped and 0 for one cut at the cap.

    >>> raw = torch.tensor([[5, 2, 6, 2, 2, 0, 9], [5, 6, 0, 9, 9, 9, 9]])  # stops {0, 2}; the sampler stops on 0
    >>> generated_stop_counts(raw, [0, 2], [0]).tolist()  # row 0: 2, 2, 2, then 0 (its stop), then padding
    [4, 1]
    """
    sampler = torch.as_tensor(sampler_stop_ids if sampler_stop_ids else stop_ids, device=raw.device)
    span = completion_mask(raw, sampler)  # [B, C] 1 up to and including the sampler's first stop
    return count_ids(raw, span, stop_ids)  # [B]


def generated_stops_of(call: dict, stop_ids: list[int]) -> torch.Tensor:
    """``generated_stop_counts`` [B] of a recorded ``generate`` call (``trainers._intercept.record_generate``):
    its raw output after the prompt, against the stop ids the sampler itself stopped on."""
    raw = call["output"][:, call["input_ids"].size(1):]  # [B, C] everything sampled, padding after its stop
    return generated_stop_counts(raw, stop_ids, call["stop_ids"])


def stop_count_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """The completion tokens on which a stop token is counted: the loss tokens, except the last
    token of each tool-loop turn that a tool result follows (its stop ends the turn, as it must).
    A healthy row then holds one stop, however many turns it took. [B, C] -> [B, C]

    >>> stop_count_mask(torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])).tolist()
    [[1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]]
    """
    mask = loss_mask.long()  # [B, C]
    after = mask.flip(-1).cumsum(-1).flip(-1) - mask  # [B, C] loss tokens after t
    next_off = torch.nn.functional.pad(mask[:, 1:], (0, 1)) == 0  # [B, C]
    turn_end = mask.bool() & next_off & (after > 0)  # [B, C]
    return mask * ~turn_end  # [B, C]


def stop_rows(tokenizer, batch: dict, lengths: torch.Tensor, generated_stops: torch.Tensor | None, stop_ids: list[int],
              headers: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a generation batch (TRL's ``_generate_and_score_completions`` output ``batch``;
    ``lengths`` [B] tokens returned per row): the stop tokens in its prompt (left padding excluded)
    and in its completion, and whether the completion starts with a chat header, as [B, 3] floats;
    also the mask the completion's stops were counted on [B, C] and those counts [B]. Completion
    stops are ``generated_stops`` where given (generate's raw output, past the cut), else those in
    every token returned (a tool loop: each turn's own stop is left out, ``stop_count_mask``)."""
    completion_ids = batch["completion_ids"]  # [B, C]
    header = torch.tensor(starts_with_header(tokenizer, completion_ids[:, :32].tolist(), headers),
                          device=completion_ids.device)  # [B]
    if "tool_mask" in batch:
        stop_mask = stop_count_mask(batch["completion_mask"] * batch["tool_mask"])  # [B, C]
    else:  # every token the sampler returned (vLLM and continuous batching return them all)
        t = torch.arange(completion_ids.size(1), device=completion_ids.device)
        stop_mask = (t < lengths.to(t.device).unsqueeze(1)).long()  # [B, C]
    completion_stops = count_ids(completion_ids, stop_mask, stop_ids) if generated_stops is None \
        else generated_stops  # [B]
    per_row = torch.stack([count_ids(batch["prompt_ids"], batch["prompt_mask"], stop_ids), completion_stops,
                           header.long()], dim=1).float()  # [B, 3]
    return per_row, stop_mask, completion_stops


def batch_metrics(per_row: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """The logged stop-token, header and zero-reward signals of a generation batch from the gathered
    ``stop_rows`` [B, 3] and rewards [B].

    >>> batch_metrics(torch.tensor([[2.0, 1.0, 0.0], [2.0, 3.0, 1.0]]), torch.tensor([0.0, 1.0]))
    {'stops/prompt_mean': 2.0, 'stops/completion_mean': 2.0, 'stops/completion_max': 3.0, \
'completions/header_share': 0.5, 'rewards/zero_share': 0.5}
    """
    means = per_row.mean(0).tolist()  # [3]
    return {"stops/prompt_mean": means[0], "stops/completion_mean": means[1],
            "stops/completion_max": per_row[:, 1].max().item(), "completions/header_share": means[2],
            "rewards/zero_share": zero_reward_share(rewards)}


def length_shares(lengths: torch.Tensor, max_length: int | None) -> dict[str, float]:
    """Share of completions with exactly 1 token and with ``max_length`` tokens (hit the cap).

    >>> length_shares(torch.tensor([1, 1, 4, 8]), 8)
    {'completions/one_token_share': 0.5, 'completions/max_length_share': 0.25}
    """
    n = max(lengths.numel(), 1)
    out = {"completions/one_token_share": (lengths == 1).sum().item() / n}
    if max_length:
        out["completions/max_length_share"] = (lengths >= max_length).sum().item() / n
    return out


def completion_shape(world: torch.Tensor, max_length: int | None, min_new_tokens: int) -> dict[str, float]:
    """``length_shares`` of every process's completions and, with ``min_new_tokens``, how often its
    processor fired per completion, from the gathered rows [world, B + 1]: B lengths, then the count.

    >>> completion_shape(torch.tensor([[1, 4, 1], [8, 8, 0]]), 8, 2)
    {'completions/one_token_share': 0.25, 'completions/max_length_share': 0.5, \
'generation/min_new_tokens_trigger_rate': 0.25}
    """
    lengths = world[:, :-1].flatten()  # [B_global]
    out = length_shares(lengths, max_length)
    if min_new_tokens:
        out["generation/min_new_tokens_trigger_rate"] = world[:, -1].sum().item() / max(lengths.numel(), 1)
    return out


# ---------------------------------------------------------------- rewards


def group_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted reward per completion as TRL sums it, NaN where every function returned None.

    >>> group_rewards(torch.tensor([[1.0, float("nan")], [float("nan")] * 2]), torch.tensor([1.0, 0.5]))
    tensor([1., nan])
    """
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)  # [B]
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))  # [B]


def flat_group_share(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups (``group_size`` consecutive completions of one prompt, as TRL groups them) that carry no
    policy gradient: every scored reward of the group equal (``torch.isclose``, as TRL's ``frac_reward_zero_std``),
    or at most one scored (NaN: no score). Unlike TRL's ``frac_reward_zero_std``, which under
    ``scale_rewards='batch'`` is the whole batch's std being 0, this is per group whatever the scaling: TRL's
    advantage is the reward minus its group's mean under every ``scale_rewards`` of ``sum_then_normalize``.

    >>> r = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, float("nan"), 2.0])  # [B=8], G=2
    >>> flat_group_share(r, 2)  # flat, flat, not flat, one scored: 3 of 4 groups
    0.75
    """
    grouped = rewards.view(-1, group_size)  # [B/G, G]
    scored = ~torch.isnan(grouped)  # [B/G, G]
    high = grouped.masked_fill(~scored, -math.inf).amax(1)  # [B/G]
    low = grouped.masked_fill(~scored, math.inf).amin(1)  # [B/G]
    flat = (scored.sum(1) <= 1) | torch.isclose(high, low)  # [B/G]
    return flat.sum().item() / flat.numel()


def nonfinite_rewards(rewards_per_func: torch.Tensor, names: list[str]) -> tuple[dict[str, float], list[str]]:
    """The +-inf rewards of a scored batch [B, K] (K reward functions, in TRL's ``reward_func_names``
    order): the share of rows each function scored +-inf, keyed ``rewards/<name>/nonfinite_share``,
    and for each function that did, a sentence naming it, how many rows and an example row (its
    index in the gathered batch, as in TRL's completions table). NaN is not counted: TRL turns a
    function's ``None`` into NaN before anyone sees it, so a NaN is TRL's "no score" either way.

    >>> r = torch.tensor([[1.0, float("inf")], [float("nan"), 0.5], [2.0, float("-inf")]])  # [B=3, K=2]
    >>> shares, found = nonfinite_rewards(r, ["a", "b"])
    >>> shares  # b: rows 0 and 2 of 3
    {'rewards/a/nonfinite_share': 0.0, 'rewards/b/nonfinite_share': 0.6666666666666666}
    >>> found
    ["reward function 'b' returned a non-finite value on 2 of 3 rows (e.g. row 0: inf)"]
    """
    bad = torch.isinf(rewards_per_func)  # [B, K]
    n = rewards_per_func.size(0)
    shares = {f"rewards/{name}/nonfinite_share": bad[:, k].sum().item() / max(n, 1) for k, name in enumerate(names)}
    found = []
    for k, name in enumerate(names):
        rows = bad[:, k].nonzero().flatten().tolist()
        if rows:
            found.append(f"reward function {name!r} returned a non-finite value on {len(rows)} of {n} rows "
                         f"(e.g. row {rows[0]}: {rewards_per_func[rows[0], k].item()})")
    return shares, found


def zero_reward_share(rewards: torch.Tensor) -> float:
    """Share of scored completions whose reward is exactly 0 (a reward signal that is all zero trains nothing).

    >>> zero_reward_share(torch.tensor([0.0, 1.0, 0.0, float("nan")]))
    0.6666666666666666
    """
    scored = rewards[~torch.isnan(rewards)]
    return (scored == 0).sum().item() / scored.numel() if scored.numel() else math.nan


def _by_task(tasks: list[str], values: torch.Tensor):
    """``(task, values of its rows)`` for each task in order of first appearance; [B] -> [B_task]."""
    for task in dict.fromkeys(tasks):
        yield task, values[torch.tensor([t == task for t in tasks], device=values.device)]


def task_lengths(tasks: list[str], lengths: torch.Tensor) -> dict[str, float]:
    """Completion length mean / min / max and the share of 1-token completions per task, keyed
    ``tasks/<task>/completions/<stat>``.

    >>> out = task_lengths(["a", "b", "a"], torch.tensor([1, 5, 4]))
    >>> out["tasks/a/completions/mean_length"], out["tasks/a/completions/one_token_share"], len(out)
    (2.5, 0.5, 8)
    """
    out = {}
    for task, x in _by_task(tasks, lengths.float()):
        out[f"tasks/{task}/completions/mean_length"] = x.mean().item()
        out[f"tasks/{task}/completions/min_length"] = x.min().item()
        out[f"tasks/{task}/completions/max_length"] = x.max().item()
        out[f"tasks/{task}/completions/one_token_share"] = (x == 1).float().mean().item()
    return out


def task_rewards(tasks: list[str], rewards: torch.Tensor) -> dict[str, float]:
    """Reward mean and (population) std per task, keyed ``tasks/<task>/reward`` and
    ``tasks/<task>/reward_std`` (NaN rewards left out).

    >>> task_rewards(["a", "b", "a"], torch.tensor([1.0, 0.0, 0.0]))
    {'tasks/a/reward': 0.5, 'tasks/a/reward_std': 0.5, 'tasks/b/reward': 0.0, 'tasks/b/reward_std': 0.0}
    """
    out = {}
    for task, x in _by_task(tasks, rewards):
        x = x[~torch.isnan(x)]
        out[f"tasks/{task}/reward"] = x.mean().item() if x.numel() else float("nan")
        out[f"tasks/{task}/reward_std"] = x.std(correction=0).item() if x.numel() else float("nan")
    return out


def task_means(tasks: list[str], values: torch.Tensor, name: str) -> dict[str, float]:
    """Mean of ``values`` [B] per task (NaN rows left out), keyed ``tasks/<task>/<name>``.

    >>> task_means(["a", "b", "a"], torch.tensor([1.0, 2.0, float("nan")]), "entropy")
    {'tasks/a/entropy': 1.0, 'tasks/b/entropy': 2.0}
    """
    return {f"tasks/{task}/{name}": torch.nanmean(x).item() for task, x in _by_task(tasks, values)}
