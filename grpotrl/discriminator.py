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
right-padded (tests/test_gad.py shows both the trap and the fix).

Teacher and student text take one path (I9): ``sequence_ids(prompt, text)`` is the RL prompt
ids (chat template + generation prompt), the response text tokenized on its own, and the
template's end-of-turn token when the response finished (a student cut at
``max_completion_length`` gets none, so D can tell it from a finished answer). Tokenizing the
response apart from the template keeps a response that starts with whitespace from merging
with the generation prompt's newline (re-rendering the whole turn did, and broke the prompt
prefix mid-training); teacher and student text are both tokenized canonically, so D cannot
tell them apart by how the sampler happened to split words.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import templates
from .errors import InputError
from .masking import position_ids_from_mask


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 of each row, whatever the padding side; [B, L] -> [B].

    >>> last_token_index(torch.tensor([[0, 1, 1], [1, 1, 0], [1, 1, 1]])).tolist()
    [2, 1, 2]
    """
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)  # [L]
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values  # [B]
    if (last < 0).any():
        raise ValueError("a row of the attention mask is all zeros: there is no token to score")
    return last


def pool_last(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden state at each row's last real token; [B, L, H] -> [B, H]."""
    index = last_token_index(attention_mask)  # [B]
    return hidden[torch.arange(hidden.size(0), device=hidden.device), index]


def bradley_terry_loss(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``mean(-log sigmoid(D(teacher) - D(student)))`` over pairs; [N], [N] -> scalar.

    >>> round(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item(), 6)  # log 2
    0.693147
    >>> round(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0])).item(), 6)  # log(1 + e^-2)
    0.126928
    """
    return -F.logsigmoid(teacher - student).mean()


def sequence_ids(tokenizer, prompt: list[dict], text: str, stop_ids: list[int], chat_template: str | None = None,
                 finished: bool = True, end_id: int | None = None) -> list[int]:
    """The scored sequence: RL prompt ids + ``text`` tokenized alone + the end-of-turn token if
    ``finished`` (``end_id``, default the template's). Teacher and student text both go through
    here (I9)."""
    response = tokenizer(text, add_special_tokens=False)["input_ids"]
    if finished:
        response = [*response, end_of_turn_id(tokenizer, chat_template) if end_id is None else end_id]
    return templates.prompt_ids(tokenizer, prompt, chat_template) + response


def end_of_turn_id(tokenizer, chat_template: str | None = None) -> int:
    """The token the chat template closes an assistant turn with (``<|im_end|>`` for ChatML,
    ``templates.end_of_turn_token_id``); eos when the template writes none."""
    eot = templates.end_of_turn_token_id(tokenizer, chat_template)
    return tokenizer.eos_token_id if eot is None else eot


def pad_sequences(seqs: list[list[int]], pad_id: int, side: str = "right",
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both [B, L], padded on ``side``.

    >>> ids, mask = pad_sequences([[5, 6], [7]], pad_id=0, side="left")
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, span] = torch.tensor(s, dtype=torch.long)
        mask[i, span] = 1
    return ids.to(device), mask.to(device)


class Discriminator(nn.Module):
    """A ``*ForSequenceClassification`` model with one output (plain or PEFT), scored at the
    last real token of each row: ``forward(input_ids, attention_mask) -> scores [B]`` (fp32).

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

    @property
    def hf_model(self) -> nn.Module:
        """The ``*ForSequenceClassification`` model under any PEFT wrapper."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        inner = self.hf_model
        out = inner.base_model(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        pooled = pool_last(out.last_hidden_state, attention_mask)  # [B, H]
        return inner.score(pooled).squeeze(-1).float()  # [B]


def load_discriminator(path: str, pad_token_id: int, dtype=None, lora_r: int = 0) -> Discriminator:
    """``AutoModelForSequenceClassification`` with one output from ``path`` (a causal LM checkpoint
    works: the backbone is reused, the ``score`` head is new), optionally with a LoRA adapter of
    rank ``lora_r`` on every linear layer (the head stays fully trainable)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    model.config.pad_token_id = pad_token_id  # only for HF's own pooling; ours reads the mask
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=lora_r, lora_alpha=2 * lora_r,
                                                 target_modules="all-linear"))
    return Discriminator(model)


class DiscriminatorReward:
    """D's score of each completion, as a TRL reward function (``rewards/discriminator/mean``).

    Scores without updating D; usable on its own, e.g. to score a finished model. GADTrainer
    builds its sequences with ``sequences`` and scores them itself, so that the forward that
    gives the reward also gives the discriminator's loss.
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

    def sequences(self, prompts: list[list[dict]], texts: list[str],
                  finished: list[bool] | None = None) -> list[list[int]]:
        finished = [True] * len(texts) if finished is None else finished
        if self._end_id is None:
            self._end_id = end_of_turn_id(self.tokenizer, self.chat_template)
        return [sequence_ids(self.tokenizer, p, t, self.stop_ids, self.chat_template, f, self._end_id)
                for p, t, f in zip(prompts, texts, finished)]

    def finished(self, completion_ids: list[list[int]]) -> list[bool]:
        """Whether each generated response ended with a stop token (TRL keeps it in the ids)."""
        return [bool(ids) and ids[-1] in self.stop_ids for ids in completion_ids]

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
        finished = self.finished(completion_ids) if completion_ids is not None else None
        return self.score(self.sequences(prompts, completion_texts(completions), finished)).tolist()


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
