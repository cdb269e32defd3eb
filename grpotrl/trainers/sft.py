"""``grpotrl.SFTTrainer``: TRL's SFTTrainer on the RL chat template (INVARIANT I2).

Overrides (everything else is TRL's):
  * ``__init__``: validates model path, tokenizer, stop tokens and dataset before TRL loads
    anything, then tokenizes conversational rows itself with
    ``templates.tokenize_sft_example``: every sequence starts with exactly the ids GRPO will
    generate from (an error otherwise), and ends at the response's first stop token, which
    is the last token in the loss (the template's trailing newline is cut).
  * ``compute_loss``: on the first ``guard_steps`` steps, checks the collated labels: each
    row's loss span is contiguous, ends at the last real token, and holds exactly one stop
    token, its last (I2).
  * ``save_model``: writes the chat-template fingerprint beside the weights (I2).
  * ``train`` / ``_load_from_checkpoint`` (``_common.CheckedResume``): a resume checkpoint is
    checked complete before anything loads; a resumed QLoRA adapter keeps its dtype.
"""

from __future__ import annotations

import logging

import torch
import trl

from .. import templates
from ..configs import SFTConfig
from ..errors import InvariantError
from ._common import CheckedResume, pin_quantized_kernels, prepare_model_and_tokenizer

logger = logging.getLogger(__name__)


def to_prompt_completion(row: dict) -> dict:
    """A ``messages`` row becomes prompt = all but the last turn, completion = the last
    (assistant) turn; prompt/completion rows pass through."""
    if "prompt" in row and "completion" in row:
        return {"prompt": row["prompt"], "completion": row["completion"]}
    msgs = row["messages"]
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}


def tokenize_dataset(dataset, tokenizer, stop_ids, chat_template=None):
    """Tokenize conversational SFT rows on the RL template (I2); other datasets pass through."""
    if dataset is None or "input_ids" in dataset.column_names:
        return dataset
    row = dataset[0]
    if not isinstance(row.get("prompt", row.get("messages")), list):
        return dataset  # plain-text data: TRL's own tokenization, no template involved

    def tok(row):
        pc = to_prompt_completion(row)
        return templates.tokenize_sft_example(tokenizer, pc["prompt"], pc["completion"], stop_ids, chat_template)

    return dataset.map(tok, remove_columns=dataset.column_names, desc="Tokenizing on the RL chat template")


class SFTTrainer(CheckedResume, trl.SFTTrainer):
    _tag_names = ["trl", "sft", "grpotrl"]
    _resume_kind = "sft"

    def __init__(self, model, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, **kwargs):
        if args is None:
            args = SFTConfig(output_dir="grpotrl-sft-output")
        model, processing_class, self.stop_token_ids, _ = prepare_model_and_tokenizer(
            model, processing_class, args, train_dataset, kind="sft", peft_config=kwargs.get("peft_config")
        )
        if args.completion_only_loss is False:
            logger.warning("completion_only_loss=False trains on prompt tokens too, which I2 rules out.")
        elif args.completion_only_loss is None:
            args.completion_only_loss = True
        train_dataset = tokenize_dataset(train_dataset, processing_class, self.stop_token_ids)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: tokenize_dataset(v, processing_class, self.stop_token_ids) for k, v in eval_dataset.items()}
        else:
            eval_dataset = tokenize_dataset(eval_dataset, processing_class, self.stop_token_ids)
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        pin_quantized_kernels(self.model)
        self._gen_prompt_ids: list[int] | None = None

    def _guard_now(self) -> bool:
        n = self.args.guard_steps
        return n < 0 or self.state.global_step < n

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._guard_now() and self.model.training and not self.args.packing and not self.args.padding_free:
            if self._gen_prompt_ids is None:
                self._gen_prompt_ids = templates.generation_prompt_ids(self.processing_class)
            check_sft_labels(self.processing_class, inputs, self.stop_token_ids, self._gen_prompt_ids)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            templates.save_fingerprint(output_dir or self.args.output_dir, self.processing_class)


def check_sft_labels(tokenizer, inputs: dict, stop_ids: list[int], gen_prompt_ids: list[int]) -> None:
    """I2 on a collated batch: the loss covers one contiguous span that starts right after the
    template's generation prompt (where RL generation starts), ends at the row's last real
    token, and holds exactly one stop token, at its end."""
    labels, attn = inputs["labels"], inputs.get("attention_mask")
    ids = inputs["input_ids"]
    stop = torch.as_tensor(stop_ids, device=ids.device)
    for i in range(labels.size(0)):
        on = (labels[i] != -100).nonzero().flatten()  # positions in the loss
        if on.numel() == 0:
            continue
        real = attn[i].nonzero().flatten() if attn is not None else torch.arange(ids.size(1))
        span_ids = ids[i, on]
        problems = []
        start = int(on[0])
        before = ids[i, max(0, start - len(gen_prompt_ids)): start].tolist()
        if gen_prompt_ids and before != gen_prompt_ids:
            problems.append(
                f"the loss starts after {tokenizer.decode(before, skip_special_tokens=False)!r}, not after the "
                f"generation prompt {tokenizer.decode(gen_prompt_ids, skip_special_tokens=False)!r}"
            )
        if on[-1] - on[0] + 1 != on.numel():
            problems.append("the loss span has holes")
        if int(on[-1]) != int(real[-1]):
            problems.append("tokens after the loss span are not padding")
        n_stop = int(torch.isin(span_ids, stop).sum())
        if n_stop != 1 or not bool(torch.isin(span_ids[-1:], stop).all()):
            problems.append(f"the span holds {n_stop} stop tokens and ends with {int(span_ids[-1])}")
        if problems:
            raise InvariantError(
                "I2",
                f"SFT row {i}: " + "; ".join(problems) + ".\n"
                f"    in the loss: {tokenizer.decode(span_ids[:60].tolist(), skip_special_tokens=False)!r}\n"
                f"    stop ids {stop_ids}\n"
                "The SFT loss must cover only the assistant response plus its end-of-turn token. Pass "
                "conversational prompt/completion (or messages) rows and let grpotrl.SFTTrainer tokenize them.",
            )
