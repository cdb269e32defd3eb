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
backward, scores equal to the whole sequences' up to float rounding; on guard steps the I9 guard compares
the hidden state the score head read for two of them with the backbone's at the last token of the same
sequence run alone (``state_gap``, ``state_tolerance``). In bench/bench_gad.py (8 students + 2
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
from ..models.sources import PeftAdapter
from ..ops.masking import last_token_index, pad_sequences, position_ids_from_mask


def pool_last(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden state at each row's last real token; [B, L, H] -> [B, H]."""
    index = last_token_index(attention_mask)  # [B]
    return hidden[torch.arange(hidden.size(0), device=hidden.device), index]


def state_gap(read: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Relative distance ``||read - reference|| / ||reference||`` of hidden states, in fp32; [N, H], [N, H] -> [N].
    NaN where either holds a NaN or the reference is 0: nothing a tolerance can pass.

    >>> state_gap(torch.tensor([[3.0, 4.0], [0.0, 5.0]]), torch.tensor([[3.0, 4.0], [3.0, 4.0]])).tolist()
    [0.0, 0.6324555277824402]
    """
    read, reference = read.float(), reference.float()
    norm = reference.norm(dim=-1)  # [N]
    return (read - reference).norm(dim=-1) / torch.where(norm > 0, norm, torch.nan)  # [N]


def state_tolerance(dtype: torch.dtype, tf32: bool = False) -> float:
    """Largest ``state_gap`` that I9 takes for batch-shape rounding between the hidden state D's head reads for a
    sequence inside its batch and the backbone's at the sequence's last token alone, for forwards in ``dtype``: in
    fp32 ``1e-4``, in bf16/fp16 ten machine epsilons of that dtype (bf16: 0.078, fp16: 0.0098). The two forwards
    differ only in batch shape (padding, packing), so their kernels round differently; a read at another token
    reads another token's state. Measured on CPU, SmolLM2-135M-Instruct with a fresh head, 200-400 sequences in
    packed, right- and left-padded batches of 8 responses + 2 teachers (largest gap of a correct read / smallest of
    a read one token early): fp32 2.6e-6 / 0.15; bf16 autocast over fp32 weights (the torch engine's D) 0.023
    (median 0.008) / 0.147; bf16 weights (DeepSpeed's D) 0.044 (median 0.015) / 0.156. Reads at a pad, a
    left-padded row read at its length and a packed batch under a plain causal mask gave 0.09 or more. The score
    is no such measure: ``sum_i w_i h_i`` over terms far larger than their sum, in bf16 it moved by up to 0.07 for
    rounding alone, and 12% of the reads one token early moved it by less than eps x ``sum_i |w_i h_i|``
    (0.07-0.11), the bound rounding took there.

    fp32 matmuls on TF32 (``tf32``: CUDA with ``torch.backends.cuda.matmul.allow_tf32``, e.g. TrainingArguments'
    ``tf32=True``) round to fp16's 10-bit mantissa: fp16's tolerance (not measured on a GPU).

    >>> state_tolerance(torch.float32), state_tolerance(torch.bfloat16), state_tolerance(torch.float16)
    (0.0001, 0.078125, 0.009765625)
    >>> state_tolerance(torch.float32, tf32=True)
    0.009765625
    """
    if dtype in (torch.bfloat16, torch.float16):
        return 10 * torch.finfo(dtype).eps
    return 10 * torch.finfo(torch.float16).eps if tf32 else 1e-4


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
    def reading(self):
        """Within: each forward appends to the yielded dict's lists what it read, detached, in fp32:
        ``head_input`` [N, H], the score head's input (each scored sequence's pooled hidden state), ``scores``
        [N], the head's output, and ``last_position`` [R, H], the backbone's hidden state at the last position of
        each row it ran (in a row of one unpadded sequence: its last token, whatever the pooling). Hooks on the
        ``score`` head and the backbone themselves, so under DDP, DeepSpeed or PEFT the copies that run."""
        seen: dict[str, list[torch.Tensor]] = {"head_input": [], "scores": [], "last_position": []}

        def head(module, args, output):
            seen["head_input"].append(args[0].detach().float())  # [N, H]
            seen["scores"].append(output.detach().float().reshape(-1))  # [N]

        def backbone(module, args, output):
            seen["last_position"].append(output[0][:, -1].detach().float())  # [R, H]

        inner = self.hf_model
        handles = [inner.score.register_forward_hook(head), inner.base_model.register_forward_hook(backbone)]
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
                       trust_remote_code: bool = False, adapter: PeftAdapter | None = None,
                       embedding_rows: int | None = None) -> Discriminator:
    """``AutoModelForSequenceClassification`` with one output from ``path`` at ``revision`` (a causal
    LM checkpoint works: the backbone is reused, the ``score`` head is new); with ``adapter``, a PEFT adapter of
    that causal LM (``path`` its base; as ``models.sources.find_adapter`` read it), that adapter merged into the
    backbone first (``merged_adapter``: D starts from the policy base + adapter is, such as a LoRA SFT's);
    optionally with a LoRA adapter of its own, of rank ``lora_r``, on every linear layer (the head stays fully
    trainable). ``freeze_embeddings`` keeps the input token embeddings as loaded (``requires_grad=False``: no
    gradient, no optimizer state; GADConfig.discriminator_freeze_embeddings)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, revision=revision,
                                                               trust_remote_code=trust_remote_code)
    model.config.pad_token_id = pad_token_id  # only for HF's own pooling; ours reads the mask
    if adapter is not None:
        model = merged_adapter(model, adapter, embedding_rows)
    if freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=lora_r, lora_alpha=2 * lora_r,
                                                 target_modules="all-linear"))
    return Discriminator(model)


def merged_adapter(model: nn.Module, adapter: PeftAdapter, embedding_rows: int | None = None) -> nn.Module:
    """``model`` (a ``*ForSequenceClassification`` over the base of the PEFT adapter ``adapter``, weights whole: not
    ZeRO-3-partitioned) with that adapter merged into its backbone (``merge_and_unload``; its weights read at
    ``adapter.revision``, its config as the preflight read it: ``PeftAdapter.peft_config``), its score head as it
    was: the backbone of the causal LM base + adapter, to the float rounding of ``model``'s dtype. The input
    embedding first takes ``embedding_rows`` rows where given and other (the student's, resized to the rows the
    adapter saved: an SFT that added tokens), then the adapter's saved rows. Every tensor the adapter saved for
    the backbone (``base_model.model.<base_model_prefix>.``) must load into it and every adapter weight of the
    backbone must be saved; the rest (the LM head, its LoRA or its ``modules_to_save`` copy) is the causal LM's
    head, which D replaces by its score head. Each parameter is trainable as it was before the merge.
    ``InputError`` otherwise, and where the embedding was resized but the adapter saved none (its new rows would
    be unset)."""
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

    config = adapter.peft_config()
    config.task_type, config.inference_mode = None, True  # a plain PeftModel: the head is D's, not a causal LM's
    embed = model.get_input_embeddings()
    resized = bool(embedding_rows) and embedding_rows != embed.num_embeddings
    if resized:
        model.resize_token_embeddings(embedding_rows, mean_resizing=False)
    names = {id(module): name for name, module in model.named_modules()}
    embed_key = f"base_model.model.{names[id(model.get_input_embeddings())]}."
    backbone = f"base_model.model.{model.base_model_prefix}."
    weights = load_peft_weights(adapter.name, device="cpu", revision=adapter.revision)  # {saved key: tensor}
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}  # PEFT freezes the base
    peft_model = PeftModel(model, config)
    result = set_peft_model_state_dict(peft_model, weights)
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(config.peft_type, "")
    unsaved = [k for k in result.missing_keys if k.startswith(backbone) and prefix in k and ".default" in k]
    unplaced = [k for k in result.unexpected_keys if k.startswith(backbone)]
    if unsaved or unplaced:
        raise InputError(
            f"The PEFT adapter {adapter.name!r} does not fit the discriminator's backbone "
            f"({type(model).__name__}): {len(unplaced)} saved tensors found no parameter (e.g. {unplaced[:2]}), "
            f"{len(unsaved)} adapter parameters no saved tensor (e.g. {unsaved[:2]}). Merge the adapter into its base "
            "(`peft.AutoPeftModelForCausalLM.from_pretrained(ADAPTER).merge_and_unload().save_pretrained(MERGED)`) and "
            "set discriminator_model_name_or_path: MERGED.")
    if resized and not any(k.startswith(embed_key) for k in weights):
        raise InputError(
            f"The discriminator's input embedding was resized to {embedding_rows} rows (the student's), but the PEFT "
            f"adapter {adapter.name!r} saved no rows for it: the added rows would be unset. Save the adapter with "
            "`save_embedding_layers=True`, or set discriminator_model_name_or_path.")
    merged = peft_model.merge_and_unload()
    for name, p in merged.named_parameters():
        p.requires_grad_(trainable[name])
    return merged


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
