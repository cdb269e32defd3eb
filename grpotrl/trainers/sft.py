"""``grpotrl.SFTTrainer``: ``trl.SFTTrainer`` plus the SFT half of INVARIANT I2, where it applies.

I2 applies to conversational prompt-completion rows trained on their completion
(``completion_only_loss`` True, or None, which TRL resolves to True for them): the SFT->RL shape,
whose prompt is what RL will prompt with. grpotrl tokenizes those rows itself
(``templates.tokenize_sft_example``) the way TRL would -- on the template in force after
``chat_template_path``, with each row's ``tools`` and ``chat_template_kwargs`` (plus grpotrl's
``SFTConfig.chat_template_kwargs``), with assistant masks for ``assistant_only_loss`` -- except that
the RL prompt ids must be a prefix of the sequence (an ``InvariantError``; TRL warns and trains on
the other rendering) and the sequence ends at its last end-of-turn token (TRL also trains on what the
template writes after it, e.g. ChatML's newline after ``<|im_end|>`` or Phi-3's eos after ``<|end|>\n``,
which RL never generates).
``messages`` rows under ``assistant_only_loss`` are tokenized and labelled by TRL, unchanged; grpotrl checks
their assistant masks, which TRL turns into the labels: every masked span must start right after the
template's generation prompt (where RL's prompt ends) and end with a stop token (where the template writes one
after an assistant turn), on the first row before any weights load (with no more spans than assistant
messages, each holding its message's text: ``chat.sft_rows.assistant_mask_problems``) and on the collated
labels of the guard steps (``check_sft_labels``); a template whose ``{% generation %}`` markers wrap anything
else (a user or system turn, the header before the generation prompt) is an ``InvariantError`` (I2), which
``guard_steps=0`` turns off; markers that also take whitespace around the turn (the newline after the
end-of-turn, as TRL's Qwen training templates do) train as TRL trains them, with one warning before the load.
Prompt-completion rows under ``assistant_only_loss`` have each marked turn of their completion checked the same
way (a tool's reply inside the completion marked for the loss stops).
Everything else -- plain text, ``messages`` without ``assistant_only_loss``, plain prompt-completion,
pre-tokenized rows, ``formatting_func``, ``skip_prepare_dataset``, vision data -- reaches TRL unchanged and
trains exactly as with ``trl.SFTTrainer``. A plain ``trl.SFTConfig`` (or a subclass) works: grpotrl's fields then
take their defaults.

The class docstring lists the hooks it overrides and what it wraps at run time.
"""

from __future__ import annotations

import logging

import torch
import trl
from datasets import Dataset
from transformers import TrainingArguments
from trl.trainer.utils import get_config_model_id, global_then_local_main_first

from ..chat import templates
from ..chat.sft_rows import (MARKERS_RULE, assistant_only_template, data_format, first_row, kwargs_variants,
                              loss_spans, span_problems, tokenize_i2_row, tool_variants)
from ..configs import SFTConfig, sft_option
from ..configs.checks import check_ranges
from ..configs.recipe_types import python_numbers
from ..errors import InputError, InvariantError
from ..guards import due
from ..guards.ranks import add_rank_agreement
from ..preflight import check_sft
from ..models.quantization import pin_quantized_kernels
from . import _intercept
from ._common import CheckedResume
from .adapter import adapter_loaded

logger = logging.getLogger(__name__)


def sft_config(args, model) -> trl.SFTConfig:
    """``args`` as TRL's SFTTrainer would take it: None -> a default config named after the model,
    plain ``TrainingArguments`` -> an SFTConfig with their values (grpotrl's, for its defaults). A TRL
    ``SFTConfig`` is range-checked here, once, its numpy scalars made Python numbers first (grpotrl's checked
    itself when it was made)."""
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return SFTConfig(f"{name.split('/')[-1]}-SFT")
    if isinstance(args, TrainingArguments) and not isinstance(args, trl.SFTConfig):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return SFTConfig(**values)
    if not isinstance(args, SFTConfig):
        python_numbers(args)  # numpy scalars TRL took (its to_json_string cannot write them)
        check_ranges(args)
    return args


class SFTTrainer(CheckedResume, trl.SFTTrainer):
    """``trl.SFTTrainer`` plus the SFT half of INVARIANT I2 (module docstring).

    Overrides (everything else is TRL's):
      * ``__init__``: checks model path, tokenizer, ``eos_token`` and datasets before TRL loads anything (what
        TRL accepts passes, ``data.checks.check_dataset``); on chat data, a template, the first I2 row's
        tokenization and, from a grpotrl checkpoint, its template fingerprint, the train rows rendered as TRL will
        render them compared with the rendering the checkpoint was trained on (``check_template``); under
        ``assistant_only_loss``, that TRL can mark assistant turns, that the first I2 row's loss keeps its
        end-of-turn token and that the first ``messages`` row's assistant mask covers only the assistant replies
        and their end-of-turn tokens (``chat.sft_rows.assistant_only_template``; not with ``guard_steps=0``); a
        PEFT adapter named by path or Hub id is loaded onto its base and trained on (``adapter.adapter_loaded``).
      * ``_prepare_dataset``: tokenizes I2 rows as above, then hands over to TRL's preparation
        (labels, truncation, packing), which takes them as pre-tokenized; the rows TRL drops because truncation
        left them no loss token are counted (a warning; all of them, an ``InputError``).
      * ``compute_loss``: on the first ``guard_steps`` steps, checks the collated labels of I2 rows and of
        ``messages`` rows under ``assistant_only_loss`` (``check_sft_labels``; not under packing or padding-free).
      * ``save_model``: writes the template fingerprint of the tokenizer saved beside the weights, with
        the ``chat_template_kwargs`` and ``tools`` the data was rendered with, whether any template rendered it and
        the template TRL rendered it with where that is not the tokenizer's (``assistant_only_loss``)
        (``_save_fingerprint``, which ``_common.CheckedResume._push_from_checkpoint`` calls too).
      * ``train`` / ``end`` / ``_load_from_checkpoint`` / ``_save_checkpoint`` / ``_push_from_checkpoint``
        (``_common.CheckedResume``):
        ``output_dir`` locked against a second run from ``train()`` to ``end()``; a resume checkpoint is
        checked complete and of this model's architecture before anything loads; a resumed QLoRA adapter
        keeps its dtype; a full disk while saving is a ``DiskFullError`` naming the file.

    Wraps nothing of TRL at run time. Reads TRL's private ``_tokenizer`` and ``_is_vlm`` through
    ``trainers/_intercept.py`` (``read_tokenizer``, ``read_is_vlm``). Changes to the model: at init,
    bitsandbytes' quantized layers are pinned to their training kernel
    (``models.quantization.pin_quantized_kernels``: a forward pre-hook on 8-bit layers, no repacking on
    4-bit ones), so eval-mode forwards compute what training does.
    """

    _tag_names = ["trl", "sft", "grpotrl"]
    _resume_kind = "sft"

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, **kwargs):
        """TRL's ``SFTTrainer.__init__`` with the same arguments, after every check that can fail before the model
        loads (``preflight.check_sft``); warns where the rows train on more than the response and its end-of-turn
        token (I2).

        Raises:
            InputError: bad input, said before any weights load.
        """
        args = sft_config(args, model)
        # every check that must pass before TRL loads the model (grpotrl/preflight/), once
        checked = check_sft(model, processing_class, args, train_dataset, eval_dataset, kwargs)
        model, processing_class, stop_ids, fmt = (checked.model, checked.processing_class, checked.stop_token_ids,
                                                  checked.data_format)
        self._checked_resume = checked.checked_resume
        tok = getattr(processing_class, "tokenizer", processing_class)
        if args.eos_token is not None and args.eos_token not in tok.get_vocab():  # TRL says so once the model loaded
            raise InputError(
                f"eos_token={args.eos_token!r} is not a token of the tokenizer {tok.name_or_path!r}, so it cannot end "
                f"sequences (its eos is {tok.eos_token!r}). Name one of its tokens (its chat template's end-of-turn "
                "token, e.g. '<|im_end|>'), or leave eos_token unset."
            )
        if args.assistant_only_loss and fmt in ("chat", "chat_prompt_completion") and args.chat_template_path is None:
            # the template TRL will mark assistant turns with, and I2 on the first row under it (before any load)
            skip = (args.dataset_kwargs or {}).get("skip_prepare_dataset")
            i2_row = first_row(train_dataset) if (fmt == "chat_prompt_completion" and not skip
                                                  and args.completion_only_loss is not False) else None
            messages_row = first_row(train_dataset) if (fmt == "chat" and not skip
                                                        and sft_option(args, "guard_steps") != 0) else None
            assistant_only_template(processing_class, stop_ids, i2_row, sft_option(args, "chat_template_kwargs"),
                                    messages_row=messages_row)
        if fmt == "chat_prompt_completion" and args.completion_only_loss is False:
            logger.warning("completion_only_loss=False trains on the prompt tokens too: I2 (SFT loss = response + "
                           "end-of-turn) is not what this run trains, and grpotrl does not check it.")
        elif fmt == "chat" and not args.assistant_only_loss:
            logger.warning("`messages` rows train on every token of the conversation, prompts included (TRL's "
                           "language modelling), so I2's SFT loss (response + end-of-turn) is not what this run "
                           "trains. For SFT followed by RL pass prompt/completion rows (or assistant_only_loss=True).")
        # what _prepare_dataset hands compute_loss: the train rows were tokenized on the RL template (I2), so their
        # collated labels can be checked
        self.i2_tokenized = False
        # and whether the train rows are `messages` rows whose labels TRL builds from the template's assistant masks
        self.messages_masked = False
        self.stop_token_ids = stop_ids
        self._template_kwargs = kwargs_variants(train_dataset, fmt, sft_option(args, "chat_template_kwargs"))
        self._template_tools = tool_variants(train_dataset, fmt)
        self._trained_on_template = fmt in ("chat_prompt_completion", "chat")
        self._guard_setup: dict | None = None
        with adapter_loaded(model, checked.adapter, args, kwargs, processing_class) as (model, kwargs):  # base + it
            super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        pin_quantized_kernels(self.model)
        add_rank_agreement(self, sft_option(args, "guard_steps"))  # I12: ranks hold one model (several ranks only)

    # --- dataset preparation -----------------------------------------------------------------

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's, except for conversational prompt-completion rows with ``completion_only_loss``: those are
        tokenized on the chat template SFT really uses (``chat.sft_rows.tokenize_i2_row``), so that the RL prompt
        ids are a prefix of each row and the loss covers the response and its end-of-turn token only (I2). Train
        rows in ``messages`` under ``assistant_only_loss`` stay TRL's; ``compute_loss`` checks their labels.

        Returns:
            dataset (Dataset): the tokenized dataset, as TRL's.

        Raises:
            InputError: truncation to ``max_length`` left no row of a map-style dataset a token in the loss.
        """
        custom = isinstance(dataset, Dataset) and dataset.format["type"] == "custom"  # TRL refuses it
        fmt = None if formatting_func is not None or custom or _intercept.read_is_vlm(self) else data_format(dataset)
        config_kwargs = sft_option(args, "chat_template_kwargs")
        if fmt == "chat" and args.assistant_only_loss and dataset_name == "train":  # TRL masks them, guard steps check
            tok = _intercept.read_tokenizer(self)
            self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *templates.stop_token_ids(tok)]))
            self.messages_masked = True
        if fmt == "chat_prompt_completion" and self.completion_only_loss:
            # the template is final here (chat_template_path applied), and so are the stop tokens
            tok = _intercept.read_tokenizer(self)
            self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *templates.stop_token_ids(tok)]))
            stops, training_template = self.stop_token_ids, self.chat_template
            assistant = args.assistant_only_loss
            end_of_turn = templates.end_of_turn_token_id(tok, training_template)  # where each sequence ends

            def tokenize(row):
                return tokenize_i2_row(row, tok, stops, config_kwargs, training_template, assistant, end_of_turn)

            map_kwargs = ({"num_proc": args.dataset_num_proc,
                           "desc": f"Tokenizing {dataset_name} dataset on the RL chat template (I2)"}
                          if isinstance(dataset, Dataset) else {})
            with global_then_local_main_first():
                dataset = dataset.map(tokenize, **map_kwargs)
            self.i2_tokenized = self.i2_tokenized or dataset_name == "train"
        elif fmt in ("chat", "chat_prompt_completion") and config_kwargs:  # TRL renders them: kwargs per row
            def with_kwargs(row):
                return {"chat_template_kwargs": {**config_kwargs, **(row.get("chat_template_kwargs") or {})}}

            with global_then_local_main_first():
                dataset = dataset.map(with_kwargs)
        prepared = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        if isinstance(dataset, Dataset) and isinstance(prepared, Dataset) and args.max_length is not None:
            _report_dropped_rows(len(dataset), len(prepared), dataset_name, args, packing)
        return prepared

    # --- guard --------------------------------------------------------------------------------

    def _guard_now(self) -> bool:
        return due(sft_option(self.args, "guard_steps"), self.state.global_step)

    def _label_claims(self) -> dict:
        """What ``check_sft_labels`` can verify on this run's I2 rows, or its ``messages`` rows under
        ``assistant_only_loss`` (computed once)."""
        if self._guard_setup is None:
            tok = _intercept.read_tokenizer(self)
            gen = (None if self._template_kwargs is None else
                   [templates.generation_prompt_ids(tok, **kw) for kw in self._template_kwargs])
            self._guard_setup = dict(
                gen_prompts=gen,
                ends_with_stop=templates.writes_stop_after_turn(tok, self.stop_token_ids, self.chat_template),
                max_length=self.args.max_length, keep_end=self.args.truncation_mode == "keep_end",
                holes=self.args.assistant_only_loss, messages=self.messages_masked and not self.i2_tokenized)
        return self._guard_setup

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's; on guard steps, for rows tokenized for I2 (or ``messages`` rows TRL labelled from the template's
        assistant masks) and neither packing nor padding-free, the collated labels are checked first
        (``check_sft_labels``: the loss covers the responses and their end-of-turn tokens, nothing of the prompt).

        Raises:
            InvariantError: the labels train on other tokens (I2).
        """
        if ((self.i2_tokenized or self.messages_masked) and self._guard_now() and self.model.training
                and not self.args.packing and not self.padding_free):
            # whitespace around the turns that the template marks: warned about on the first row, before the load
            check_sft_labels(_intercept.read_tokenizer(self), inputs, self.stop_token_ids, **self._label_claims())
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's, then the chat-template fingerprint (``grpotrl_template.json``: the template, its kwargs and tools,
        whether SFT trained on it) beside the weights, which GRPO checks (I2). A full disk is a ``DiskFullError``."""
        with self.disk_full_named(output_dir or self.args.output_dir, "the model", _internal_call):
            super().save_model(output_dir, _internal_call)
            if self.args.should_save:
                self._save_fingerprint(output_dir or self.args.output_dir)

    def _save_fingerprint(self, output_dir: str) -> None:
        """The fingerprint with the ``chat_template_kwargs`` and ``tools`` SFT's data was rendered with, and the
        template TRL rendered the train rows with where it is not the tokenizer's (``trained_template``: TRL's
        ``self.chat_template``, its ``{% generation %}`` variant under ``assistant_only_loss``, which the tokenizer
        saved beside the weights does not carry). Rows grpotrl tokenized for I2 have their prompts rendered with the
        tokenizer's own template (a prefix of every row), so nothing else is recorded for them."""
        trained = self.chat_template if self._trained_on_template and not self.i2_tokenized else None
        templates.save_fingerprint(output_dir, _intercept.read_tokenizer(self),
                                   chat_template_kwargs=self._template_kwargs,
                                   trained_on_template=self._trained_on_template, tools=self._template_tools,
                                   trained_template=trained)


def _report_dropped_rows(n_in: int, n_out: int, dataset_name: str, args, packing: bool) -> None:
    """TRL drops, unsaid, each row that truncation to ``max_length`` leaves without a loss token (a prompt that
    alone fills it): all of them is an ``InputError`` here (TRL fails at ``train()`` on ``num_samples=0``); some,
    a warning with the count (not countable once rows are packed)."""
    if n_in and not n_out:
        raise InputError(
            f"Every row of the {dataset_name!r} dataset ({n_in}) was dropped: truncated to max_length="
            f"{args.max_length} (truncation_mode={args.truncation_mode!r}), none keeps a token in the loss (its "
            "prompt alone fills max_length). Raise `max_length`, or shorten the prompts."
        )
    if not packing and n_out < n_in:
        logger.warning("%d of the %d rows of the %r dataset were dropped: truncated to max_length=%d (truncation_mode="
                       "%r), they keep no token in the loss (the prompt alone fills max_length). Raise `max_length` "
                       "to train on them.", n_in - n_out, n_in, dataset_name, args.max_length, args.truncation_mode)


def check_sft_labels(tokenizer, inputs: dict, stop_ids: list[int], gen_prompts: list[list[int]] | None = None,
                     ends_with_stop: bool = True, max_length: int | None = None, keep_end: bool = False,
                     holes: bool = False, messages: bool = False) -> list[str]:
    """I2 on a collated batch, claiming only what holds for its rows (``chat.sft_rows.span_problems``, the one
    span check): the loss starts right after one of ``gen_prompts`` (the template's generation prompt, per set of
    chat_template_kwargs; None, or a set whose template writes none: not checked) and its last token is a stop
    token (when the template writes one after an assistant turn). Rows tokenized on the RL template: the loss is
    one contiguous span that ends at the row's last real token, unless ``holes`` (assistant-only loss masks the
    non-assistant turns of a completion: each maximal span of the loss is checked as above). ``messages``:
    ``messages`` rows whose labels TRL built from the template's assistant masks, each maximal span checked as
    above. Under ``holes`` or ``messages``, whitespace the template writes around a turn (marked by TRL's Qwen
    training templates) is no problem: it is described in the list returned (empty otherwise). A row
    cut by ``max_length`` is checked only on the side truncation left intact. Labels are -100 outside the loss;
    the attention mask (when given) says which tokens are real."""
    notes: list[str] = []
    labels, attn, ids = inputs["labels"], inputs.get("attention_mask"), inputs["input_ids"]  # [B, L] each
    holes = holes or messages
    for i in range(labels.size(0)):
        on = (labels[i] != -100).nonzero().flatten()  # positions in the loss
        if on.numel() == 0:
            continue
        real = attn[i].nonzero().flatten() if attn is not None else torch.arange(ids.size(1))
        cut = max_length is not None and real.numel() >= max_length
        first, last = int(real[0]), int(real[-1]) + 1  # the row's real tokens: [first, last)
        row, in_loss = ids[i, first:last].tolist(), (labels[i, first:last] != -100).tolist()
        spans = loss_spans(in_loss) if holes else [(int(on[0]) - first, int(on[-1]) + 1 - first)]
        problems = []
        if not holes and on[-1] - on[0] + 1 != on.numel():
            problems.append("the loss span has holes")
        if not holes and not (cut and not keep_end) and int(on[-1]) + 1 != last:  # the end survived truncation
            problems.append("tokens after the loss span are not padding")
        problems += span_problems(tokenizer, row, spans, stop_ids, gen_prompts, ends_with_stop,
                                  start_cut=cut and keep_end, end_cut=cut and not keep_end,
                                  whitespace=notes if holes else None, per_turn=holes)
        if problems:
            why = (f"These are `messages` rows: TRL built their labels from the chat template's assistant masks. "
                   f"{MARKERS_RULE} Fix the template's markers (for every row: its tools and chat_template_kwargs "
                   "too), or pass prompt/completion rows (grpotrl tokenizes those for I2 itself). "
                   if messages else
                   "grpotrl.SFTTrainer tokenized these rows on the RL template, their loss the completion's turns "
                   f"that the chat template's `{{% generation %}}` markers mark (assistant_only_loss). {MARKERS_RULE} "
                   "Fix the template's markers, or drop assistant_only_loss (completion_only_loss then trains the "
                   "whole completion); else something after the tokenization changed the labels (a custom "
                   "data_collator?). "
                   if holes else
                   "The SFT loss must cover only the assistant response up to its end-of-turn token, right after "
                   "the RL prompt. grpotrl.SFTTrainer tokenized these rows that way, so something after it changed "
                   "the labels (a custom data_collator?). ")
            raise InvariantError(
                "I2",
                f"SFT row {i}: " + "; ".join(problems) + ".\n"
                f"    in the loss: {tokenizer.decode(ids[i, on][:60].tolist(), skip_special_tokens=False)!r}\n"
                f"    stop ids {stop_ids}\n" + why + "`guard_steps=0` turns this check off.",
            )
    return notes
