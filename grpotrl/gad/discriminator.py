"""The GAD discriminator: a sequence scorer read at the last real token (INVARIANT I9).

Letters: B rows, L sequence width, H hidden size.

Why not HF's own pooling: ``*ForSequenceClassification`` (transformers 5) reads the score at
the rightmost token that is not ``pad_token_id``. With SmolLM2 ``pad == eos == <|im_end|>``,
the token that closes every turn, so a response that ends properly is read one token early,
at its last content token, while a truncated one is read at its last token: the readout
position depends on whether the student stopped, and never sees the end-of-turn itself.
It also passes no position ids, so a left-padded row of an absolute-position model (GPT-2)
is read at other positions than the same row alone. ``Discriminator`` runs the backbone
itself and reads the hidden state at the last position whose attention mask is 1, with
position ids from the mask, so a sequence scores the same alone, left-padded or
right-padded (tests/trainers/test_gad.py shows both the trap and the fix).

Teacher and student text take one path (I9): ``sequence_ids(prompt, text)`` is the RL prompt
ids (chat template + generation prompt), the response text tokenized on its own, and the
template's end-of-turn token when the response finished (a student cut at
``max_completion_length`` gets none, so D can tell it from a finished answer). Tokenizing the
response apart from the template keeps a response that starts with whitespace from merging
with the generation prompt's newline (re-rendering the whole turn did, and broke the prompt
prefix mid-training); teacher and student text are both tokenized canonically, so D cannot
tell them apart by how the sampler happened to split words.

Cost: a group's students and its teacher share their prompt, which in GAD's short answers is
most of each sequence (SmolLM2's template alone is ~45 tokens). ``scoring_batch`` packs a batch:
each prompt once, then the responses to it, in rows of at most 1024 tokens and no padding
between sequences, with an attention mask under which every token sees only its own prompt and
its own response (``packed_attention``) and position ids of the whole sequence. One forward and
backward, scores equal to the whole sequences' up to float rounding; the I9 guard compares one
with the same sequence scored alone on guard steps. In bench/bench_gad.py (8 students + 2
teachers, 2 prompts of ~45 tokens) D reads 220-310 tokens instead of 10 rows padded to ~78, and
its forward and backward take ~40% of the CPU time they took.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..chat import templates
from ..errors import InputError
from ..models.dropout import has_dropout
from ..ops.masking import last_token_index, pad_sequences, position_ids_from_mask


def pool_last(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden state at each row's last real token; [B, L, H] -> [B, H]."""
    index = last_token_index(attention_mask)  # [B]
    return hidden[torch.arange(hidden.size(0), device=hidden.device), index]


def score_tolerance(score: float, dtype: torch.dtype, scale: float = 0.0) -> float:
    """Largest ``|D(x alone) - D(x in its batch)|`` that I9 takes for batch-shape rounding, for a score read
    from the head's dot product ``sum_i w_i h_i`` whose terms sum to ``scale = sum_i |w_i h_i|`` in size
    (``Discriminator.reading_scale``; 0: unknown). With ``size = max(1, |score|, scale / 4)``: in fp32 ``2e-5 x
    size`` (measured on CPU), in bf16/fp16 four machine epsilons of that dtype ``x size`` (bf16: 0.031 each),
    so at least one epsilon per unit of ``scale``. The two forwards differ only in batch shape, so their kernels
    round the hidden state differently, and the score carries that rounding at the size of its terms, not of
    their sum: SmolLM2 with a fresh head scores within [-0.4, 2] from terms of size 9-14, and on CPU in bf16
    (400 sequences, packed and padded batches of 8 responses + 2 teachers) a score moved by up to 0.52 eps x
    scale (median 0.08), past four epsilons of the score alone (0.031). On an H100 in bf16 SmolLM2's scores
    differed by 0.0078, one bf16 epsilon. A score read at the wrong token differs by the whole signal, not by
    a rounding step: read one token early, SmolLM2's fresh D moved by 0.14-0.46 (tolerance there 0.11).

    >>> score_tolerance(0.5, torch.float32), score_tolerance(3.0, torch.bfloat16)
    (2e-05, 0.09375)
    >>> score_tolerance(0.4, torch.bfloat16, scale=12.0)  # 4 x 2^-7 x 12 / 4
    0.09375
    """
    size = max(1.0, abs(score), scale / 4)
    if dtype in (torch.bfloat16, torch.float16):
        return 4 * torch.finfo(dtype).eps * size
    return 2e-5 * size


def bradley_terry_loss(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``mean(-log sigmoid(D(teacher) - D(student)))`` over pairs; [N], [N] -> scalar.

    >>> round(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item(), 6)  # log 2
    0.693147
    >>> round(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0])).item(), 6)  # log(1 + e^-2)
    0.126928
    """
    return -F.logsigmoid(teacher - student).mean()


def sequence_parts(tokenizer, prompt: list[dict], text: str, chat_template: str | None = None,
                   finished: bool = True, end_id: int | None = None) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of the scored sequence: the RL prompt ids (chat template +
    generation prompt), then ``text`` tokenized alone + the end-of-turn token if ``finished``
    (``end_id``, default the template's). Teacher and student text both go through here (I9)."""
    response = tokenizer(text, add_special_tokens=False)["input_ids"]
    if finished:
        response = [*response, end_of_turn_id(tokenizer, chat_template) if end_id is None else end_id]
    return templates.prompt_ids(tokenizer, prompt, chat_template), response


def sequence_ids(tokenizer, prompt: list[dict], text: str, chat_template: str | None = None,
                 finished: bool = True, end_id: int | None = None) -> list[int]:
    """The scored sequence: ``sequence_parts`` joined, RL prompt ids + response ids."""
    prompt_ids, response = sequence_parts(tokenizer, prompt, text, chat_template, finished, end_id)
    return prompt_ids + response


def end_of_turn_id(tokenizer, chat_template: str | None = None) -> int:
    """The token the chat template closes an assistant turn with (``<|im_end|>`` for ChatML,
    ``templates.end_of_turn_token_id``); eos when the template writes none."""
    eot = templates.end_of_turn_token_id(tokenizer, chat_template)
    return tokenizer.eos_token_id if eot is None else eot


MAX_ROW_TOKENS = 1024  # a packed row's attention is [W, W]: bounded, as padded rows' [L, L] are


def scoring_batch(parts: list[tuple[list[int], list[int]]], pad_id: int, device=None, pack: bool = True,
                  max_row_tokens: int = MAX_ROW_TOKENS) -> dict[str, torch.Tensor]:
    """Keyword arguments of ``Discriminator.forward`` that score ``prompt + response`` for each of
    ``parts`` (``sequence_parts``), N of them.

    Plain (``pack=False``, or no prompt shared): ``input_ids``/``attention_mask`` [N, L], right-padded.
    Packed: each prompt is written once, followed by the responses to it, in rows of at most
    ``max_row_tokens`` tokens (a prompt shared by more responses than fit is written again in the
    next row; one prompt + one response longer than that gets a row of its own). ``input_ids``,
    ``position_ids`` (each token's position in its own whole sequence), ``block`` (which prompt
    copy a token belongs to, -1 for padding) and ``member`` (0 for prompt tokens, ``1 + i`` for
    the tokens of response ``i``, -1 for padding), all [R, W] right-padded; ``score_index`` [N]:
    where in the flattened [R * W] each sequence's last token is (its prompt's last token when the
    response is empty). Attention follows ``packed_attention``: a token sees its prompt and the
    earlier tokens of its own response, nothing else, so each sequence scores as if alone.

    >>> b = scoring_batch([([1, 2], [7]), ([1, 2], [8, 9]), ([4], [])], pad_id=0)
    >>> b["input_ids"].tolist(), b["position_ids"].tolist()
    ([[1, 2, 7, 8, 9, 4]], [[0, 1, 2, 2, 3, 0]])
    >>> b["block"].tolist(), b["member"].tolist(), b["score_index"].tolist()
    ([[0, 0, 0, 0, 0, 1]], [[0, 0, 1, 2, 2, 0]], [2, 4, 5])
    """
    groups: dict[tuple, list[int]] = {}  # prompt ids -> the sequences that share it
    for i, (prompt, _) in enumerate(parts):
        groups.setdefault(tuple(prompt), []).append(i)
    if not pack or len(groups) == len(parts) or any(not prompt for prompt in groups):
        ids, mask = pad_sequences([prompt + response for prompt, response in parts], pad_id, device=device)
        return {"input_ids": ids, "attention_mask": mask}

    rows: list[dict[str, list[int]]] = []
    score_index = [0] * len(parts)
    blocks = 0
    for prompt, members in groups.items():
        row = None
        for i in members:
            response = parts[i][1]
            if row is None or len(row["ids"]) + len(response) > max_row_tokens:
                if not rows or len(rows[-1]["ids"]) + len(prompt) + len(response) > max_row_tokens:
                    rows.append({"ids": [], "pos": [], "block": [], "member": []})
                row = rows[-1]
                start = len(row["ids"])  # this copy of the prompt
                row["ids"] += prompt
                row["pos"] += range(len(prompt))
                row["block"] += [blocks] * len(prompt)
                row["member"] += [0] * len(prompt)
                blocks += 1
            row["ids"] += response
            row["pos"] += range(len(prompt), len(prompt) + len(response))
            row["block"] += [blocks - 1] * len(response)
            row["member"] += [1 + i] * len(response)
            last = len(row["ids"]) - 1 if response else start + len(prompt) - 1
            score_index[i] = (len(rows) - 1, last)
    width = max(len(r["ids"]) for r in rows)

    def pad(key, value):
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in rows], dtype=torch.long, device=device)

    return {"input_ids": pad("ids", pad_id), "position_ids": pad("pos", 0), "block": pad("block", -1),
            "member": pad("member", -1),
            "score_index": torch.tensor([r * width + c for r, c in score_index], dtype=torch.long, device=device)}


def packed_attention(block: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Which key each query of a packed row attends to: [R, W] -> [R, 1, W, W] bool. A token sees
    the earlier tokens of its prompt copy and of its own response; padding sees only itself (a
    query with no key at all would give NaN; its output is never read).

    >>> packed_attention(torch.tensor([[0, 0, 0, 0, -1]]), torch.tensor([[0, 1, 2, 2, -1]]))[0, 0].int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    """
    width = block.size(1)
    position = torch.arange(width, device=block.device)
    causal = position[None, :] <= position[:, None]  # [W(query), W(key)]
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, None, :] >= 0)  # [R, W, W]
    visible = (member[:, None, :] == 0) | (member[:, None, :] == member[:, :, None])  # prompt, or own response
    return ((causal & same_block & visible) | torch.eye(width, dtype=torch.bool, device=block.device))[:, None]


class Discriminator(nn.Module):
    """A ``*ForSequenceClassification`` model with one output (plain or PEFT), scored at the
    last real token of each row: ``forward(input_ids, attention_mask) -> scores [B]`` (fp32), or
    ``forward(**scoring_batch(parts))``, each shared prompt run once.

    Runs the backbone (``model.base_model``) and the ``score`` head itself rather than the
    model's forward, whose pooling keys on ``pad_token_id`` (module docstring). Being one
    module, it can be wrapped by DDP as a whole.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        inner = self.hf_model
        if not isinstance(getattr(inner, "score", None), nn.Module) or inner.base_model is inner:
            raise InputError(
                f"{type(inner).__name__} has no `score` head over a separate backbone (`base_model`), so the "
                "discriminator cannot read its score at the last real token itself (INVARIANT I9). Use a model "
                "whose *ForSequenceClassification class has both, as Llama, Qwen2, Mistral and GPT-2 do."
            )
        if getattr(inner.config, "num_labels", 1) != 1:
            raise InputError(f"The discriminator must have one output (num_labels=1), got {inner.config.num_labels}.")
        self._packable: bool | None = None  # can_pack()'s parts that never change; read at first use

    @property
    def hf_model(self) -> nn.Module:
        """The ``*ForSequenceClassification`` model under any PEFT wrapper."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, block: torch.Tensor | None = None,
                member: torch.Tensor | None = None, score_index: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [N] of the rows of ``input_ids`` [N, L] and their ``attention_mask``; or of a
        packed batch (``scoring_batch``: ``input_ids``, ``position_ids``, ``block``, ``member``,
        ``score_index``), in which each shared prompt runs once. Same scores up to float rounding."""
        inner = self.hf_model
        if block is None:
            out = inner.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids_from_mask(attention_mask), use_cache=False)
            return inner.score(pool_last(out.last_hidden_state, attention_mask)).squeeze(-1).float()  # [N]
        if not self.can_pack():
            raise InputError("This discriminator cannot score a packed batch now (dropout active in training, or "
                             "an attention it cannot pass a mask to); build the batch with scoring_batch(..., "
                             "pack=discriminator.can_pack()).")
        allowed = packed_attention(block, member)  # [R, 1, W, W]
        if inner.config._attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = inner.dtype
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)
        out = inner.base_model(input_ids=input_ids, attention_mask=allowed, position_ids=position_ids,
                               use_cache=False)  # a 4D mask goes to the attention as it is
        hidden = out.last_hidden_state.flatten(0, 1)[score_index]  # [N, H]
        return inner.score(hidden).squeeze(-1).float()  # [N]

    @contextlib.contextmanager
    def reading_scale(self):
        """Within: each forward appends to the yielded list ``sum_i |w_i h_i|`` (+ ``|bias|``) of each row's score
        [N] (fp32), read inside the head's own forward from its input ``h`` and weights ``w`` (so under DeepSpeed
        ZeRO-3 its gathered weights, under PEFT the copy that runs): the size of the terms the score head sums,
        which its rounding in low precision follows (``score_tolerance``)."""
        seen: list[torch.Tensor] = []

        def read(module, args, output):
            terms = (args[0].detach().float().abs() * module.weight.detach().float().abs()[0]).sum(-1)  # [N]
            seen.append(terms + (module.bias.detach().float().abs()[0] if module.bias is not None else 0.0))

        handles = [m.register_forward_hook(read, prepend=True) for m in self.hf_model.score.modules()
                   if isinstance(m, nn.Linear)]
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()

    def can_pack(self) -> bool:
        """Whether a packed batch (``scoring_batch``) scores as the whole sequences do: an attention
        that takes a 4D mask as given (sdpa, eager), position ids, no sliding window, and no dropout
        active (in a packed row, sequences would share the prompt's dropout mask)."""
        inner = self.hf_model
        cfg = inner.config
        if self._packable is None:
            layer_types = getattr(cfg, "layer_types", None)
            if layer_types is not None:
                full_attention = all(t == "full_attention" for t in layer_types)
            else:  # a sliding window the packed mask would not apply
                full_attention = not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))
            self._packable = (full_attention and not getattr(cfg, "is_encoder_decoder", False)
                              and "position_ids" in inspect.signature(inner.base_model.forward).parameters)
        return (self._packable and getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager")
                and not (self.training and has_dropout(self)))


def load_discriminator(path: str, pad_token_id: int, dtype=None, lora_r: int = 0,
                       freeze_embeddings: bool = False, revision: str | None = None,
                       trust_remote_code: bool = False) -> Discriminator:
    """``AutoModelForSequenceClassification`` with one output from ``path`` at ``revision`` (a causal
    LM checkpoint works: the backbone is reused, the ``score`` head is new), optionally with a LoRA
    adapter of rank ``lora_r`` on every linear layer (the head stays fully trainable).
    ``freeze_embeddings`` keeps the input token embeddings as loaded (``requires_grad=False``: no
    gradient, no optimizer state; GADConfig.discriminator_freeze_embeddings)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, revision=revision,
                                                               trust_remote_code=trust_remote_code)
    model.config.pad_token_id = pad_token_id  # only for HF's own pooling; ours reads the mask
    if freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=lora_r, lora_alpha=2 * lora_r,
                                                 target_modules="all-linear"))
    return Discriminator(model)


class DiscriminatorReward:
    """D's score of each completion, as a TRL reward function (``rewards/discriminator/mean``).

    Scores without updating D; usable on its own, e.g. to score a finished model. GADTrainer
    builds its sequences with ``parts`` and ``batch`` and scores them itself, so that the forward
    that gives the reward also gives the discriminator's loss.
    """

    __name__ = "discriminator"

    def __init__(self, discriminator: nn.Module | None, tokenizer, stop_ids: list[int],
                 chat_template: str | None = None, batch_size: int = 8):
        self.discriminator = discriminator
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.chat_template = chat_template
        self.batch_size = batch_size
        self._end_id: int | None = None  # the template's end-of-turn id, read at first use
        self._served: list[float] | None = None  # scores a caller already has (``serving``)

    @contextlib.contextmanager
    def serving(self, scores: torch.Tensor):
        """Within: a call returns ``scores`` [N] (D's scores of exactly the rows it is called with, which
        GADTrainer's D step computed) instead of scoring again, so they reach TRL's and grpotrl's reward
        handling as any reward function's do."""
        self._served = scores.tolist()
        try:
            yield
        finally:
            self._served = None

    def parts(self, prompts: list[list[dict]], texts: list[str],
              finished: list[bool] | None = None) -> list[tuple[list[int], list[int]]]:
        """``(prompt ids, response ids)`` of each scored sequence (``sequence_parts``)."""
        finished = [True] * len(texts) if finished is None else finished
        if self._end_id is None:
            self._end_id = end_of_turn_id(self.tokenizer, self.chat_template)
        return [sequence_parts(self.tokenizer, p, t, self.chat_template, f, self._end_id)
                for p, t, f in zip(prompts, texts, finished)]

    def sequences(self, prompts: list[list[dict]], texts: list[str],
                  finished: list[bool] | None = None) -> list[list[int]]:
        return [prompt + response for prompt, response in self.parts(prompts, texts, finished)]

    def batch(self, parts: list[tuple[list[int], list[int]]], device=None) -> dict[str, torch.Tensor]:
        """The discriminator's keyword arguments for ``parts``: ``scoring_batch``, packed when the
        discriminator (under any DDP or DeepSpeed wrapper) can take it in its current mode."""
        d = self.discriminator
        d = d.module if isinstance(getattr(d, "module", None), Discriminator) else d
        return scoring_batch(parts, self.tokenizer.pad_token_id, device=device,
                             pack=isinstance(d, Discriminator) and d.can_pack())

    def finished(self, completion_ids: list[list[int]]) -> list[bool]:
        """Whether each generated response ended with a stop token (TRL keeps it in the ids)."""
        return [bool(ids) and ids[-1] in self.stop_ids for ids in completion_ids]

    def texts(self, completion_ids: list[list[int]]) -> list[str]:
        """The text each student generated, decoded from its ids without the closing stop token and with
        every other special token kept: what D must judge. TRL's completions skip special tokens, so a
        response of ``<file_sep>`` tokens or one that opens a new ``<|im_start|>`` turn read to D as an
        empty or a plain answer. Re-tokenized by ``parts`` as the teacher's text is (special token strings
        come back as their ids)."""
        cut = [ids[:-1] if done else ids for ids, done in zip(completion_ids, self.finished(completion_ids))]
        return self.tokenizer.batch_decode(cut, skip_special_tokens=False)

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> torch.Tensor:
        """Scores [N] of token sequences, in chunks of ``batch_size``."""
        device = next(self.discriminator.parameters()).device
        out = []
        for i in range(0, len(seqs), self.batch_size):
            ids, mask = pad_sequences(seqs[i:i + self.batch_size], self.tokenizer.pad_token_id, device=device)
            out.append(self.discriminator(ids, mask))
        return torch.cat(out)

    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[float]:
        """D's scores of the generated responses: of ``completion_ids`` where given (``texts``, ``finished``),
        else of the ``completions`` text, taken as finished; within ``serving``, the scores served."""
        if self._served is not None:  # TRL checks there is one per row
            return self._served
        if completion_ids is None:
            return self.score(self.sequences(prompts, completion_texts(completions))).tolist()
        texts = self.texts(completion_ids)
        return self.score(self.sequences(prompts, texts, self.finished(completion_ids))).tolist()


def completion_texts(completions: list) -> list[str]:
    """The response text of each TRL completion (a string, or one assistant message).

    >>> completion_texts(["12", [{"role": "assistant", "content": "13"}]])
    ['12', '13']
    """
    texts = []
    for c in completions:
        if isinstance(c, str):
            texts.append(c)
        elif len(c) == 1 and isinstance(c[0].get("content"), str):
            texts.append(c[0]["content"])
        else:
            raise InputError(f"The discriminator scores one plain-text assistant message per completion, got {c!r} "
                             "(tool calls and multimodal content are not supported by GAD).")
    return texts
