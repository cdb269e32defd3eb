"""The checks that must pass before any weights load, in one place, run once per trainer.

Every grpotrl trainer's ``__init__`` calls its ``check_*`` function here before handing over to
TRL, which then loads the model. The CLI builds the trainer from the model path and its load
settings (``model_init_kwargs``, as ``trl grpo`` and open-r1 do) instead of repeating these
checks; it keeps only what has no Python-API counterpart (recipe keys and types, the quantization
fields, the ``output_dir`` rule) and hands over the reward names (``rewards.resolve.RewardNames``).
A dataset that already passed is not read again (``data.checks.check_dataset``: GAD checks rows
before its teacher responses, GRPO's steps then find them checked).

The order, each step an ``InputError`` (or ``InvariantError`` I2) saying what to change:
1. ``output_dir`` not a file (the config's own ranges were checked once, by the config: ``configs.checks``);
2. the datasets (``data.checks.check_dataset``; GAD: ``check_teacher_responses`` first);
3. the model: its source (``models.sources.check_model_source``: a complete local dir, or a Hub id that is
   reachable or cached; a PEFT adapter takes no ``peft_config``, its tokenizer and config may be its base's),
   tokenizer files, the tokenizer (loaded as TRL loads it), a chat
   template where the data is conversational, the stop tokens; a loaded quantized model needs
   LoRA; prompts the context cannot hold; the checkpoint's template fingerprint (I2);
4. GRPO: a recipe's reward names resolved (``rewards.resolve.RewardNames``); every reward callable
   as TRL calls it (``rewards.resolve.check_reward_callables``: not a class, a non-callable or a
   builtin without TRL's keywords); the columns every
   reward function and judge reads (``rewards.resolve.check_reward_columns``, from Python too);
   multi-task: ``check_tasks`` (every task labelled and rewarded; CAGrad's needs); reward models
   by path or Hub id (weights and tokenizer files: ``rewards.resolve.check_reward_sources``), I6 generation
   settings, the model's own generation_config.json on the transformers generate path
   (beam search where the sampler's logprobs are recorded, fields under which generate cannot return one completion
   per prompt; a warning for fields that change the sampled distribution),
   settings this trainer would ignore, reward columns empty
   everywhere; GAD: the discriminator's source (first); SFT: I2 on the first row;
5. ``args.resume_from_checkpoint``, when set: complete, LoRA vs full as this run, written by a
   model of this run's architecture (``config.json``; LoRA: rank, target modules, base model), the
   same template (I2); ``train()`` then resumes from it without checking it again.
Then GRPO's local judges load (``rewards.recipe.LocalJudgeSpec``), last.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import NamedTuple

from ..chat import templates
from ..chat.sft_rows import assistant_only_template, data_format, first_row, tokenize_i2_row
from ..checkpoints import check_output_dir, check_resume_architecture, read_config, resume_checkpoint
from ..configs import GADConfig, sft_option
from ..configs.checks import (BEAMS_UNRECORDED, CUT_SHORT, NO_OFF, SAMPLING_CHANGES, UNRUNNABLE_GENERATION,
                              recorded_settings)
from ..configs.launch import sharded_launch
from ..data import SPLIT_NAMES
from ..data.checks import check_chat_prompts_for_tools, check_dataset, check_prompt_lengths
from ..errors import InputError
from ..generation.processors import build_processors
from ..models import resolve_model_path
from ..models.quantization import pin_quantized_kernels, quantization_set_twice, quantized_bits
from ..models.sources import (AdapterLookup, PeftAdapter, adapter_tokenizer_path, adapter_tokenizer_source,
                              adapter_tokenizer_unloadable, check_model_source, check_tokenizer_source, find_adapter,
                              generation_config, model_file)
from ..ops.loss_types import LOSS_TYPES
from ..rewards.recipe import load_local_judges
from ..rewards.resolve import (RewardNames, check_reward_callables, check_reward_columns, check_reward_signal,
                               check_reward_sources, check_reward_weights)
from ..rewards.tasks import per_task
from .model import check_adapter_peft_config, check_discriminator_source, check_lora_targets, merge_advice

logger = logging.getLogger(__name__)
_NOT_GIVEN = object()
CAGRAD_DISTRIBUTED_ERROR = ("cagrad={mode!r} runs in one process or under DDP (accelerate's multi-GPU/multi-CPU); "
                            "DeepSpeed (any ZeRO stage) and FSDP own the gradients it combines and are not "
                            "supported. Use recipes/accelerate/ddp.yaml, or cagrad: off under ZeRO.")


def _is_conversational(dataset) -> bool:
    if dataset is None or not hasattr(dataset, "column_names"):
        return True
    try:
        row = next(iter(dataset))
    except StopIteration:
        return True
    value = row.get("prompt", row.get("messages"))
    return isinstance(value, list)


def datasets_of(*datasets):
    """Each dataset given, a dict of datasets (``eval_dataset``) opened up, None left out."""
    for ds in datasets:
        yield from (d for d in (ds.values() if isinstance(ds, dict) else [ds]) if d is not None)


def split_name(dataset, default: str) -> str:
    """The split ``dataset`` was loaded as (``Dataset.split``, or the recipe's ``dataset_train_split``
    / ``dataset_test_split`` as ``data.pick_split`` picked it), else ``default``."""
    try:
        picked = SPLIT_NAMES.get(dataset)
    except TypeError:
        picked = None
    return str(getattr(dataset, "split", None) or picked or default)


def named_splits(train_dataset, eval_dataset) -> list[tuple[str, object]]:
    """``[(name, dataset)]`` of the splits given (``split_name``; ``train``, ``eval`` or the dict keys)."""
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)]
    return [(split_name(ds, name), ds) for name, ds in [("train", train_dataset), *evals] if ds is not None]


def task_labels(column: str, *datasets) -> list[str]:
    """Sorted task labels in ``column`` of the map-style datasets that have it ([] if none)."""
    return sorted({str(t) for d in datasets_of(*datasets)
                   if hasattr(d, "unique") and column in (d.column_names or []) for t in d.unique(column)})


class PreparedModel(NamedTuple):
    """What ``prepare_model_and_tokenizer`` hands the step that called it:

    * ``model``: the resolved name where it was given as a string (an alias becomes its cached directory), else the
      model given;
    * ``processing_class``: the one given, else the one loaded as TRL's trainer loads it;
    * ``stop_token_ids``: every end id (I4): eos, the chat template's end-of-turn, the generation config's;
    * ``model_id``: the directory or Hub id the model's files come from (None: a loaded model that names none);
    * ``adapter``: the PEFT adapter the name holds (None: a plain or loaded model).
    """

    model: object
    processing_class: object
    stop_token_ids: list[int]
    model_id: str | None
    adapter: PeftAdapter | None


def prepare_model_and_tokenizer(model, processing_class, args, train_dataset, kind: str, peft_config=_NOT_GIVEN,
                                prompt_optional: bool = False, eval_dataset=None, quantization_config=None,
                                adapter_lookup: AdapterLookup | None = None) -> PreparedModel:
    """Steps 1-3: resolve aliases and check config, datasets, model, tokenizer and stop tokens.

    ``model`` is a local directory, a Hugging Face Hub id (``args.model_init_kwargs["revision"]``
    honoured, as TRL does) or a loaded model. Returns a ``PreparedModel``: ``adapter`` the PEFT adapter ``model``
    names (``models.sources.find_adapter``, read here once for the run start, or taken from ``adapter_lookup``
    where an earlier step of the same start asked for this name and revision: GAD's; None for a plain or loaded
    model), which the later checks and the trainer's load (``trainers.adapter.adapter_loaded``) take.
    A tokenizer not given is loaded exactly as TRL's trainer would load it (``AutoProcessor``; GRPO pads and
    truncates on the left), a PEFT adapter's from its own files, else its base's
    (``models.sources.adapter_tokenizer_source``: worked out here, only where the tokenizer loads; a Hub id's is
    one listing of its files, or a request per tokenizer file name where listing fails; its own files offline from
    its cached snapshot, ``models.sources.adapter_tokenizer_path``).
    When the trainer passes its ``peft_config`` (None included), a loaded quantized
    model must come with one or be a PEFT model already, and so must a model TRL loads with the
    trainer's ``quantization_config`` or ``model_init_kwargs['quantization_config']`` (not both:
    ``models.quantization.quantization_set_twice``); ``model_init_kwargs``'
    dtype must be one TRL reads (``_check_init_dtype``). Bitsandbytes layers are pinned to
    one kernel (``models.quantization.pin_quantized_kernels``). ``prompt_optional``: rows may lack ``prompt`` (an
    ``environment_factory``'s ``reset`` supplies it). SFT passes no datasets: ``check_sft`` checks them.
    """
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    check_output_dir(args.output_dir, overwrite=True)  # only a file where output_dir should be (the rest: train())
    for name, dataset in named_splits(train_dataset, eval_dataset):
        check_dataset(dataset, name, kind=kind, prompt_optional=prompt_optional)
    revision = adapter = None
    if model is None or isinstance(model, str):
        model = resolve_model_path(model)
        init_kwargs = getattr(args, "model_init_kwargs", None) or {}
        revision = init_kwargs.get("revision")
        _check_init_dtype(init_kwargs)
        asked = adapter_lookup is not None and (adapter_lookup.name, adapter_lookup.revision) == (model, revision)
        # a PEFT adapter: the trainer trains it (trainers.adapter)
        adapter = adapter_lookup.adapter if asked else find_adapter(model, revision)
        trains = peft_config if adapter is None else adapter.config  # the adapter is this run's LoRA
        if quantization_config is not None and "quantization_config" in init_kwargs:  # TRL: a ValueError at its load
            raise InputError(quantization_set_twice(quantization_config, init_kwargs["quantization_config"]))
        _refuse_quantized_full_finetune(_config_bits(init_kwargs.get("quantization_config")), trains,
                                        "model_init_kwargs['quantization_config'] asks for")
        _refuse_quantized_full_finetune(_config_bits(quantization_config), trains,
                                        "The trainer's quantization_config asks for")
        check_model_source(model, revision)
        if adapter is not None:
            check_adapter_peft_config(model, None if peft_config is _NOT_GIVEN else peft_config)
        targets = getattr(peft_config, "target_modules", None) if peft_config is not _NOT_GIVEN else None
        if targets:  # PEFT trains the names that match and ignores a misspelled one
            check_lora_targets(sorted(targets) if isinstance(targets, (set, frozenset)) else targets, model, revision,
                               "peft_config.target_modules")
        model_id = model
    else:
        model_id = get_config_model_id(model.config) or None
        if not hasattr(model, "peft_config"):  # a PEFT model trains its adapters
            _refuse_quantized_full_finetune(quantized_bits(model), peft_config, "The model is loaded in")
        pin_quantized_kernels(model)
    if processing_class is None:
        if model_id is None:
            raise InputError("The model has no name or path to load its tokenizer from: pass `processing_class`.")
        source = model_id if adapter is None else adapter_tokenizer_source(adapter)  # an adapter's own, else its base's
        source_revision = revision if source == model_id else adapter.base_revision
        check_tokenizer_source(source, source_revision)  # not transformers' "Unrecognized processing class"
        sides = {"truncation_side": "left", "padding_side": "left"} if kind == "grpo" else {}
        own = adapter is not None and source == adapter.name  # the adapter's own files, no config.json beside them
        try:
            processing_class = AutoProcessor.from_pretrained(adapter_tokenizer_path(adapter) if own else source,
                                                             revision=source_revision,
                                                             trust_remote_code=args.trust_remote_code, **sides)
        except OSError as err:
            if not own:
                raise
            raise InputError(adapter_tokenizer_unloadable(adapter, err)) from err
    if train_dataset is not None and _is_conversational(train_dataset):  # SFT passes None: it checks its own
        templates.require_chat_template(processing_class)
    stop_ids = templates.stop_token_ids(processing_class, model_generation_config(model, args, adapter))
    if kind == "grpo" and train_dataset is not None:  # prompts the model's context cannot hold (config only)
        base = adapter.base if adapter is not None else None  # an adapter's config is its base's
        check_prompt_lengths(train_dataset, split_name(train_dataset, "train"),
                             getattr(processing_class, "tokenizer", processing_class), base or model_id,
                             adapter.base_revision if base else revision,
                             getattr(args, "max_completion_length", None),
                             **(getattr(args, "chat_template_kwargs", None) or {}))
    return PreparedModel(model, processing_class, stop_ids, model_id, adapter)


TRL_DTYPES = ("bfloat16", "float16", "float32", "auto")  # the strings trl's create_model_from_path reads as dtype


def _check_init_dtype(init_kwargs: dict) -> None:
    """``model_init_kwargs``' weight dtype, as TRL 1.16 reads it: ``dtype``, a ``torch.dtype`` or one of
    ``TRL_DTYPES`` (TRL raises a ValueError at the load otherwise). ``torch_dtype``, transformers' old name, is
    refused: TRL always passes ``dtype`` (float32 unless set) and transformers then ignores ``torch_dtype``, so
    ``torch_dtype: bfloat16`` loaded float32 weights, silently."""
    if "torch_dtype" in init_kwargs:
        raise InputError(f"model_init_kwargs sets torch_dtype={init_kwargs['torch_dtype']!r}, a name transformers no "
                         "longer reads when dtype is given, and TRL always gives dtype (float32 unless set): the "
                         "weights would load in float32. Write it as dtype (e.g. model_init_kwargs: {dtype: "
                         "bfloat16}).")
    dtype = init_kwargs.get("dtype")
    if isinstance(dtype, str) and dtype not in TRL_DTYPES:
        close = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        hint = f" (write {close[dtype.lower()]!r})" if dtype.lower() in close else ""
        raise InputError(f"model_init_kwargs' dtype={dtype!r} is not one TRL reads: one of {', '.join(TRL_DTYPES)}, or "
                         f"a torch.dtype{hint}.")


def model_generation_config(model, args, adapter: PeftAdapter | None):
    """The model's own ``GenerationConfig``, where TRL's ``generate`` finds it: a directory's or Hub id's
    ``generation_config.json`` (at ``args.model_init_kwargs``' revision; a PEFT adapter's, ``adapter``, else its
    base's), a loaded model's ``generation_config``; None when it has none."""
    if isinstance(model, str):
        return generation_config(model, (getattr(args, "model_init_kwargs", None) or {}).get("revision"), adapter)
    return getattr(model, "generation_config", None)


def _config_bits(quantization_config) -> int | None:
    """4 or 8 when a ``quantization_config`` (a ``BitsAndBytesConfig`` or its dict) loads in bitsandbytes."""
    get = quantization_config.get if isinstance(quantization_config, Mapping) else \
        lambda name: getattr(quantization_config, name, False)
    return 4 if get("load_in_4bit") else 8 if get("load_in_8bit") else None


def _refuse_quantized_full_finetune(bits: int | None, peft_config, what: str) -> None:
    """A quantized model without LoRA: transformers' Trainer would refuse it only after the load."""
    if bits and peft_config is None:  # _NOT_GIVEN: the trainer does not say, so not checked
        raise InputError(
            f"{what} {bits}-bit (bitsandbytes) weights and no peft_config was given, so the "
            f"trainer would fully fine-tune a quantized model, whose {bits}-bit weights cannot take an update. Pass "
            "`peft_config=peft.LoraConfig(...)` (QLoRA: LoRA adapters on the frozen quantized base; from a "
            "recipe: `use_peft: true`), or load the model without quantization_config."
        )


class ResumeCheck(NamedTuple):
    """What ``check_resume`` checked: the value given, the checkpoint path it resolved to (None: no
    resume), and how, so that ``train(resume_from_checkpoint=other)`` checks ``other`` the same way."""

    given: object
    checkpoint: str | None
    kind: str  # "sft", "grpo" or "gad": which files a complete checkpoint holds
    chat_template_kwargs: dict | None  # compared with the checkpoint's fingerprint (None: SFT, compared on rows)
    tool_sets: list | None = None  # the tools prompts are rendered with, compared likewise (templates.grpo_tool_sets)


def check_resume(args, kind: str, tokenizer, use_peft: bool, chat_template_kwargs: dict | None = None,
                 given=_NOT_GIVEN, model=None, peft_config=None, tool_sets: list | None = None,
                 adapter: PeftAdapter | None = None) -> ResumeCheck:
    """Step 5: the resume checkpoint checked complete, written by a model of this run's architecture
    (``model``: its path or Hub id, the PEFT adapter it names in ``adapter``, or the loaded model; None: not
    compared) and on this run's
    template (with ``chat_template_kwargs`` and ``tool_sets``, where given, and the template GRPO renders prompts
    with for those tools: ``templates.grpo_prompt_template``); ``given`` defaults to
    ``args.resume_from_checkpoint`` (``train(resume_from_checkpoint=...)`` passes its own)."""
    given = getattr(args, "resume_from_checkpoint", None) if given is _NOT_GIVEN else given
    checkpoint = resume_checkpoint(given, args, kind, use_peft)
    if checkpoint and model is not None:
        _check_resume_architecture(checkpoint, model, args, peft_config, adapter)
    if checkpoint and getattr(args, "check_template", True):  # I2: the checkpoint's template is this run's
        templates.check_fingerprint(checkpoint, tokenizer, chat_template_kwargs=chat_template_kwargs,
                                    tool_sets=tool_sets,
                                    rl_template=templates.grpo_prompt_template(tokenizer, tool_sets))
    return ResumeCheck(given, checkpoint, kind, chat_template_kwargs, tool_sets)


def _check_resume_architecture(checkpoint: str, model, args, peft_config, adapter: PeftAdapter | None) -> None:
    """``checkpoints.check_resume_architecture`` against the model's config: its ``config.json`` read
    by name (no weights) for a path or Hub id (a PEFT adapter, ``adapter``: its base's), ``model.config`` for a
    loaded model."""
    if isinstance(model, str):
        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        if adapter is not None:  # the base's config, and the adapter's shape as this run's LoRA settings
            revision, model = adapter.base_revision, adapter.base or model
            peft_config = SimpleNamespace(r=adapter.config.get("r"),
                                          target_modules=adapter.config.get("target_modules"))
        config = read_config(model_file(model, "config.json", revision))
        if config is not None:
            check_resume_architecture(checkpoint, config, model, peft_config)
    elif getattr(model, "config", None) is not None:
        check_resume_architecture(checkpoint, model.config, getattr(model.config, "_name_or_path", None),
                                  peft_config)


def _uses_peft(model, peft_config, adapter: PeftAdapter | None) -> bool:
    """Whether the run trains a PEFT adapter: a ``peft_config``, a PEFT model, or a PEFT adapter named by path or
    Hub id (``adapter``: ``prepare_model_and_tokenizer``'s), which the trainer loads and trains."""
    return peft_config not in (None, _NOT_GIVEN) or hasattr(model, "peft_config") or adapter is not None


# ---------------------------------------------------------------------------------------------
# GRPO (and its subclasses)
# ---------------------------------------------------------------------------------------------

class GRPOCheck(NamedTuple):
    """What ``check_grpo`` hands ``GRPOTrainer.__init__``:

    * ``model``: the resolved name where it was given as a string (an alias becomes its cached directory), else the
      model given;
    * ``processing_class``: the one given, else the one loaded as TRL's trainer loads it (padding and truncating on
      the left);
    * ``reward_funcs``: as TRL takes them (one, or a list): a recipe's names resolved, local judges loaded, rewards
      per task made TRL's flat list (``rewards.tasks.per_task``);
    * ``stop_token_ids``: every end id (I4): eos, the chat template's end-of-turn, the generation config's;
    * ``checked_resume``: the resume checkpoint as checked (step 5, ``ResumeCheck``), which ``train()`` does not
      check again;
    * ``adapter``: the PEFT adapter the model's name holds (None: a plain or loaded model), for
      ``trainers.adapter.adapter_loaded``.
    """

    model: object
    processing_class: object
    reward_funcs: object
    stop_token_ids: list[int]
    checked_resume: ResumeCheck
    adapter: PeftAdapter | None


# a private keyword of GRPOTrainer.__init__'s and SFTTrainer.__init__'s **kwargs (not TRL's): an ``AdapterLookup``
# of the model that a step before the trainer's preflight made (the CLI's recipe check, ``preflight.model.
# check_model_args``; a subclass's own checks, GADTrainer's), read by ``check_grpo`` / ``check_sft`` (taken only at
# the same name and revision: ``prepare_model_and_tokenizer``) and dropped before TRL's __init__
# (``trainers.adapter.adapter_loaded``)
ADAPTER_LOOKUP = "_grpotrl_adapter_lookup"


def check_grpo(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, kwargs: dict, *,
               trainer_name: str, multitask: bool, resume_kind: str) -> GRPOCheck:
    """Every check of ``GRPOTrainer.__init__`` (GAD's and multi-task's run theirs first) before TRL
    loads anything; then the local judges load (``rewards.recipe.LocalJudgeSpec``) and rewards per
    task become TRL's flat list. ``trainer_name``: the trainer class, as errors name it; ``multitask``: the
    trainer reads task labels (rewards per task, CAGrad: ``MultiTaskGRPOTrainer``); ``resume_kind``: the
    trainer kind whose checkpoints a resume must hold ("grpo", "gad"). ``kwargs[ADAPTER_LOOKUP]``, where a
    trainer's own checks looked the model up first (GAD's), is that answer (``prepare_model_and_tokenizer``'s
    ``adapter_lookup``). Returns a ``GRPOCheck``."""
    peft_config = kwargs.get("peft_config")
    model, processing_class, stop_ids, model_id, adapter = prepare_model_and_tokenizer(
        model, processing_class, args, train_dataset, kind="grpo", peft_config=peft_config,
        prompt_optional=kwargs.get("environment_factory") is not None, eval_dataset=eval_dataset,
        quantization_config=kwargs.get("quantization_config"), adapter_lookup=kwargs.get(ADAPTER_LOOKUP),
    )
    if kwargs.get("tools"):  # TRL's tool loop reads completions as chat messages
        for name, dataset in named_splits(train_dataset, eval_dataset):
            check_chat_prompts_for_tools(dataset, name)
    template_kwargs = args.chat_template_kwargs or {}
    # the tools TRL will render prompts with (None: a factory's, known only once TRL calls it)
    tool_sets = templates.grpo_tool_sets(kwargs.get("tools"), kwargs.get("environment_factory"))
    if getattr(args, "check_template", True):  # a factory's unknown tools: one warning there
        templates.check_fingerprint(model_id, processing_class, chat_template_kwargs=template_kwargs,
                                    revision=(args.model_init_kwargs or {}).get("revision"), tool_sets=tool_sets,
                                    rl_template=templates.grpo_prompt_template(processing_class, tool_sets),
                                    prompts=train_dataset, tools_unknown=tool_sets is None)
    if isinstance(reward_funcs, RewardNames):  # a recipe's names (the CLI): resolved once model and rows passed
        reward_funcs = reward_funcs.resolve()
    check_reward_callables(reward_funcs, getattr(train_dataset, "column_names", None),  # callable as TRL calls them
                           environments=kwargs.get("environment_factory") is not None)
    if kwargs.get("environment_factory") is None:  # an environment's reset may supply what rows lack
        scored_eval = eval_dataset if args.eval_strategy != "no" else None  # TRL never scores an unused eval set
        for name, dataset in named_splits(train_dataset, scored_eval):  # the columns the rewards read
            check_reward_columns(reward_funcs, dataset, name)
    if multitask:
        check_tasks(reward_funcs, args, train_dataset, eval_dataset)
    elif isinstance(reward_funcs, Mapping):
        raise InputError(f"reward_funcs maps tasks to functions ({list(reward_funcs)}), which "
                         f"{trainer_name} does not read: use grpotrl.MultiTaskGRPOTrainer (rows labelled "
                         "in task_column), or pass one list of reward functions.")
    # reward models by name (TRL loads them after the policy): weights and tokenizer files, named by index
    check_reward_sources(reward_funcs, (args.model_init_kwargs or {}).get("revision"),
                         kwargs.get("reward_processing_classes"))
    if not getattr(args, "use_kl_in_reward", False):  # its KL column is counted where it is added
        check_reward_weights(reward_funcs, args.reward_weights)
    _check_kl_reference(model, args, peft_config, adapter)
    _check_generation_args(args, kwargs)
    if kwargs.get("rollout_func") is None:  # a rollout_func samples without generate
        gen_config, source = model_generation_config(model, args, adapter), model if isinstance(model, str) else None
        _check_model_beams(args, gen_config, source)
        _check_model_generation_fields(args, gen_config, source, processing_class)
    if not multitask and (args.cagrad != "off" or args.cagrad_c != 0.5):
        raise InputError(f"cagrad={args.cagrad!r}, cagrad_c={args.cagrad_c} on {trainer_name}, which trains "
                         "one summed loss and would ignore them: CAGrad needs grpotrl.MultiTaskGRPOTrainer (rows "
                         "labelled by task_column). Use it, or drop the cagrad settings.")
    if args.dynamic_sampling and not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        raise InputError("dynamic_sampling draws refill prompts by index: pass a map-style train_dataset "
                         "(datasets.Dataset), not an IterableDataset, or turn dynamic_sampling off.")
    # a reward column empty everywhere (per task: on the task's own rows)
    check_reward_signal(reward_funcs, train_dataset, split_name(train_dataset, "train"), args.task_column)
    resume = check_resume(args, resume_kind, processing_class, _uses_peft(model, peft_config, adapter),
                          template_kwargs, model=model, peft_config=peft_config, tool_sets=tool_sets, adapter=adapter)
    reward_funcs = load_local_judges(reward_funcs, args.device)  # every check passed: the judges' weights
    if isinstance(reward_funcs, Mapping):
        reward_funcs = per_task(reward_funcs, args.task_column)
    return GRPOCheck(model, processing_class, reward_funcs, stop_ids, resume, adapter)


def no_kl_reference(beta, kl_in_reward_coef) -> str:
    """The error for ``use_kl_in_reward`` with ``beta`` 0 and no PEFT adapter, from the run's ``beta`` and
    ``kl_in_reward_coef`` (None: the reward's coefficient is ``beta``): what is missing and the two remedies
    ``GRPOConfig`` accepts. Raised before the model loads (``check_grpo``) and by the trainer where it finds no
    reference to compute the KL column with (``trainers.reference_kl.ReferenceKL._ref_context``).

    With ``beta`` > 0 TRL did build a reference (a model, or the PEFT adapter disabled): only a trainer whose
    reference went away after ``__init__`` (``ref_model`` set to None, the adapter merged) meets it, and the error
    says so instead.

    >>> message = no_kl_reference(0.0, 0.01)
    >>> "set beta: 0.01 (with use_kl_loss off" in message and "drop kl_in_reward_coef" in message
    True
    >>> "set beta" in no_kl_reference(0.04, None)
    False
    """
    if beta:
        return (f"use_kl_in_reward with beta={beta}: the trainer has no reference model (ref_model is None) and its "
                "model no PEFT adapter to disable, so the reward's KL has no reference. trl.GRPOTrainer built one "
                "with the trainer (beta > 0): it was removed afterwards (ref_model set to None, or the adapter "
                "merged into the model, e.g. merge_and_unload). Keep the trainer's reference, and merge an adapter "
                "only after training.")
    coef = beta if kl_in_reward_coef is None else kl_in_reward_coef
    return (f"use_kl_in_reward with beta={beta} and no PEFT adapter: trl.GRPOTrainer loads a reference model only "
            "when beta > 0 (with PEFT, the policy with its adapter disabled is the reference), so the reward's KL "
            f"would have no reference. For a KL in the reward only, set beta: {coef} (with use_kl_loss off, beta is "
            "the reward's coefficient), use_kl_loss: false, and drop kl_in_reward_coef; or train a LoRA adapter "
            "(peft_config), whose disabled adapter is the reference.")


def _check_kl_reference(model, args, peft_config, adapter: PeftAdapter | None) -> None:
    """``use_kl_in_reward`` with ``beta`` 0 and no PEFT (a ``peft_config``, a PEFT model, a PEFT adapter by path
    or Hub id): TRL loads a reference model only when beta > 0 (with PEFT the disabled adapter is the
    reference), so the KL column would find none at the first reward: refused before compute
    (``no_kl_reference``). With ``beta`` 0 on a PEFT adapter that is trained already it is refused too: TRL copies
    a PEFT model's adapter as the reference (``ref``) only when beta > 0, and the disabled adapter would be the
    base model, not the policy this run starts from. An adapter by name (``adapter``: SFT's) counts as trained; a
    ``peft.PeftModel`` passed in is trained where a LoRA B weight of its active adapter is not 0 (PEFT starts
    every B at 0, so a fresh adapter adds nothing and the base is the policy), and is refused as well where that
    cannot be read: weights partitioned by DeepSpeed ZeRO-3 or on the meta device, another PEFT type than LoRA,
    or DoRA (whose magnitudes move the model with B at 0): ``_unverified_fresh_adapter``."""
    if not getattr(args, "use_kl_in_reward", False) or args.beta:
        return
    coef = args.beta if args.kl_in_reward_coef is None else args.kl_in_reward_coef
    remedy = (f"Set beta: {coef} (with use_kl_loss: false, beta is the reward's coefficient and the loss has no KL) "
              "and drop kl_in_reward_coef")
    why = ("trl.GRPOTrainer copies a trained adapter as the KL's reference (adapter 'ref': the policy this run "
           "starts from) only when beta > 0; with beta 0 the reference would be the base model with the adapter "
           "disabled, so the KL would measure the adapter's own training, not this run's.")
    if adapter is not None:
        raise InputError(f"use_kl_in_reward with beta={args.beta} on the PEFT adapter {model!r}: {why} {remedy}.")
    if hasattr(model, "peft_config"):
        found = _unverified_fresh_adapter(model)
        if found is not None:
            raise InputError(
                f"use_kl_in_reward with beta={args.beta} on the peft.PeftModel passed as model, whose adapter "
                f"{found}: {why} {remedy}; or, for a new adapter, pass the base model with "
                "peft_config=peft.LoraConfig(...) (its disabled adapter is then this run's starting policy).")
        return
    if not _uses_peft(model, peft_config, adapter):
        raise InputError(no_kl_reference(args.beta, args.kl_in_reward_coef))


def _unverified_fresh_adapter(model) -> str | None:
    """Why the active adapter of the PEFT model ``model`` is not known to be fresh (the base model is the
    policy), said for an error; None where it is a LoRA adapter whose every B weight (``lora_B``,
    ``lora_embedding_B``) reads 0, as PEFT initialises it. A weight that cannot be read (partitioned by DeepSpeed
    ZeRO-3: 0 elements here, the real ones in ``ds_numel``; on the meta device) is not trusted to be 0."""
    active = model.active_adapters if hasattr(model, "active_adapters") else [model.active_adapter]
    active = active() if callable(active) else active  # transformers' own PEFT integration: a method
    active = [active] if isinstance(active, str) else list(active)
    for name in active:
        config = model.peft_config[name]
        peft_type = str(getattr(config.peft_type, "value", config.peft_type))
        if peft_type != "LORA":
            return (f"{name!r} is a {peft_type} adapter, whose start cannot be told from the base model's (only a "
                    "LoRA adapter's B weights at 0 show that it adds nothing)")
        if getattr(config, "use_dora", False):
            return (f"{name!r} is a DoRA adapter, whose trained magnitudes would change the model with its B "
                    "weights at 0, so B at 0 does not show that it adds nothing")
        if getattr(config, "trainable_token_indices", None):
            return (f"{name!r} trains token embeddings (trainable_token_indices), whose trained rows replace the "
                    "base's with the adapter on, so B at 0 does not show that it adds nothing")
    for module_name, module in model.named_modules():  # modules_to_save: a trained copy replaces the base's module
        copies = getattr(module, "modules_to_save", None)
        original = getattr(module, "original_module", None)
        for name in (active if copies is not None and original is not None and hasattr(copies, "keys") else []):
            if name in copies and not _same_weights(copies[name], original):
                return (f"{name!r} has a modules_to_save copy of {module_name} that differs from the base's "
                        "(trained before this run, or unreadable: partitioned by DeepSpeed ZeRO-3)")
    trained, unread = [], []
    markers = [f".{kind}.{name}." for name in active for kind in ("lora_B", "lora_embedding_B")]
    # PEFT's names: "...q_proj.lora_B.default.weight", "...embed_tokens.lora_embedding_B.default"
    for param_name, param in model.named_parameters():
        if not any(marker in f".{param_name}." for marker in markers):
            continue
        if param.numel() == 0 or param.is_meta:  # ZeRO-3's partitioned parameter, or not materialised
            unread.append(param_name)
        elif bool(param.detach().any()):
            trained.append(param_name)
    if trained:
        return (f"has LoRA B weights that are not 0 ({len(trained)}, e.g. {trained[0]}; PEFT starts every B at 0): "
                "trained before this run, or not initialised at 0 (init_lora_weights), so the base model with the "
                "adapter disabled is not the policy this run starts from")
    if unread:
        return (f"has LoRA B weights that cannot be read here ({len(unread)}, e.g. {unread[0]}: partitioned by "
                "DeepSpeed ZeRO-3 or on the meta device), so whether it was trained before this run cannot be "
                "checked, and an unchecked adapter is not taken as fresh")
    return None


def _same_weights(copy, original) -> bool:
    """Whether two modules hold equal, readable parameters (a ZeRO-3-partitioned one, 0 elements, is unreadable)."""
    pairs = list(zip(copy.parameters(), original.parameters()))
    return all(a.numel() and not a.is_meta and a.shape == b.shape and a.detach().equal(b.detach())
               for a, b in pairs) and len(pairs) == len(list(original.parameters()))


def _check_generation_args(args, kwargs: dict) -> None:
    """I6 arguments (penalties and ``min_new_tokens`` valid, and not in the multi-turn loop of ``tools`` or an
    ``environment_factory`` nor beside a ``rollout_func``, which samples without them), the loss type and what ``hf_importance_sampling_correction`` needs, before TRL loads
    anything."""
    build_processors(0, args.presence_penalty, args.frequency_penalty, args.repetition_penalty,
                     args.min_new_tokens, [0])
    if args.min_new_tokens and args.max_completion_length and args.min_new_tokens >= args.max_completion_length:
        raise InputError(f"min_new_tokens={args.min_new_tokens} must be < max_completion_length="
                         f"{args.max_completion_length}, or no completion could ever stop.")
    penalties = {name: value for name, value in (("presence_penalty", args.presence_penalty), ("frequency_penalty",
                 args.frequency_penalty), ("min_new_tokens", args.min_new_tokens)) if value}
    own = {**penalties, **({"repetition_penalty": args.repetition_penalty} if args.repetition_penalty != 1.0 else {})}
    multi_turn = [name for name in ("tools", "environment_factory") if kwargs.get(name)]
    # on transformers' generate grpotrl applies the repetition penalty itself (transformers' own is set to 1), and
    # not in the tool loop; vLLM applies its own (over the prompt too: warned in configs.checks)
    unsupported = own if not getattr(args, "use_vllm", False) else penalties
    if unsupported and multi_turn:
        raise InputError(f"{', '.join(f'{k}={v}' for k, v in unsupported.items())} with {' and '.join(multi_turn)}: "
                         "presence/frequency/repetition penalties and min_new_tokens are not supported in the "
                         "multi-turn tool loop yet (it calls generate once per turn, and each call would count its "
                         "own turn's tokens only; on transformers' generate the repetition penalty would not run at "
                         "all). Set them to their defaults (0, and repetition_penalty 1.0).")
    if own and kwargs.get("rollout_func") is not None:
        raise InputError(f"{', '.join(f'{k}={v}' for k, v in own.items())} with a rollout_func: grpotrl applies these "
                         "as logits processors inside transformers' generate, which a rollout_func replaces, so they "
                         "would be silently dropped. Apply them in your rollout_func's own sampler (response tokens "
                         "only, INVARIANT I6) and leave these settings at their defaults.")
    if args.loss_type not in LOSS_TYPES:  # TRL would fail at the first loss, after generation
        raise InputError(f"loss_type={args.loss_type!r} is not one of TRL 1.16's loss types: "
                         f"{', '.join(LOSS_TYPES)}.")
    if args.hf_importance_sampling_correction and LOSS_TYPES[args.loss_type].folds_sampler_ratio:
        raise InputError("hf_importance_sampling_correction folds the ratio into the advantages, which is not "
                         f"equivalent for loss_type={args.loss_type!r}, whose loss weighs each sequence by the "
                         "ratio itself. Use another loss_type or turn the correction off.")


def _check_model_beams(args, gen_config, source: str | None) -> None:
    """Beam search that the model's own generation config (``gen_config``, read from ``source``) asks for, refused
    beside the settings that record the sampler's logprobs, as ``generation_kwargs``' ``num_beams`` is
    (``configs.checks``). TRL builds its ``GenerationConfig`` from its own sampling fields (``max_new_tokens``,
    ``do_sample``, the stop and pad ids, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``cache_implementation``) and ``generation_kwargs``; transformers' ``generate`` then
    fills every field left None from the model's, ``num_beams`` among them. So the model's ``num_beams`` runs
    unless ``generation_kwargs`` sets one. vLLM samples without it."""
    recorded = recorded_settings(args)
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    beams = getattr(gen_config, "num_beams", None)
    if args.use_vllm or not recorded or kwargs.get("num_beams") is not None or not isinstance(beams, int) \
            or beams <= 1:
        return
    where = f"generation_config.json of {source}" if source else "generation_config of the model passed"
    raise InputError(
        f"num_beams={beams} in the {where} (transformers' generate uses it wherever generation_kwargs sets no "
        f"num_beams) with {', '.join(f'{k}={v}' for k, v in recorded.items())}: {BEAMS_UNRECORDED}. Pass "
        "generation_kwargs={'num_beams': 1} (the model's file stays as it is; GRPO samples each completion on its "
        "own), or leave these settings at their defaults.")


def _model_fields(table: dict, gen_config, kwargs: dict, trl_sets: set) -> dict:
    """The fields of ``table`` (``configs.checks``' shape) that ``gen_config`` sets and ``generate`` takes from it:
    neither ``generation_kwargs`` (``kwargs``; None there is filled from the model's too) nor TRL (``trl_sets``)
    sets them. Name -> (the model's value, what it does, the value that turns it off)."""
    found = {}
    for name, (is_set, what, off) in table.items():
        value = getattr(gen_config, name, None)
        if value is not None and is_set(value) and kwargs.get(name) is None and name not in trl_sets:
            found[name] = (value, what, off)
    return found


def _turn_off(name: str, off, source: str | None) -> str:
    """How to sample without the model's ``name``: ``off`` in ``generation_kwargs``, or (``NO_OFF``: generate
    fills None from the model's) the field removed from the model's generation config."""
    if off is not NO_OFF:
        return f"pass generation_kwargs={{'{name}': {off!r}}} (the model's file stays as it is)"
    unset = f"set model.generation_config.{name} = None"
    if source is None:
        return f"{unset} before passing the model (no generation_kwargs value turns it off)"
    return (f"remove it from generation_config.json in a copy of {source}, or load the model, {unset} and pass the "
            "model (no generation_kwargs value turns it off)")


def _check_model_generation_fields(args, gen_config, source: str | None, processing_class) -> None:
    """What the model's own generation config (``gen_config``, read from ``source``) adds to TRL's sampling on the
    transformers generate path. TRL builds its ``GenerationConfig`` from ``max_new_tokens``, ``do_sample``, the stop
    and pad ids, ``temperature``, ``top_p``, ``top_k``, ``min_p`` (None unless set), ``repetition_penalty``,
    ``cache_implementation`` (and a VLM's ``suppress_tokens``), then ``generation_kwargs``; transformers'
    ``generate`` fills every field still None from the model's (``_prepare_generation_config``, 5.24). So:

    * a field under which ``generate`` cannot return one sampled completion per prompt row
      (``configs.checks.UNRUNNABLE_GENERATION``: each fails at the first rollout, after the load), or ``max_time``
      (``CUT_SHORT``): an ``InputError`` naming the field, its value, the file, and how to turn it off;
    * a field that changes the distribution completions are sampled from (``SAMPLING_CHANGES``): one warning naming
      each, what it does and how to turn it off. Taken, as TRL takes it and as grpotrl takes the same field in
      ``generation_kwargs``: a sampling choice like grpotrl's own processors (I6), whose effect the sampler/trainer
      gap measures where the sampler's logprobs are recorded;
    * ``min_new_tokens``: on this path grpotrl's field is the one setting (the trainer sets transformers' own to 0),
      so the model's is not applied: warned where it differs from the field.

    A field ``generation_kwargs`` sets is the user's and is not checked here. vLLM samples with the
    ``SamplingParams`` TRL builds from its own fields and ``generation_kwargs`` (``trl.generation.vllm_generation``);
    continuous batching with TRL's generation config as it is (``generate_batch`` fills nothing from the model's).
    Neither is checked here."""
    from transformers import ProcessorMixin

    if gen_config is None or args.use_vllm or args.use_transformers_continuous_batching:
        return
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    trl_sets = {"min_p"} if args.min_p is not None else set()
    trl_sets |= {"suppress_tokens"} if isinstance(processing_class, ProcessorMixin) else set()  # the image token
    where = f"generation_config.json of {source}" if source else "generation_config of the model passed"
    for name, (value, what, off) in _model_fields({**UNRUNNABLE_GENERATION, **CUT_SHORT}, gen_config, kwargs,
                                                  trl_sets).items():
        raise InputError(f"{name}={value!r} in the {where} {what}; transformers' generate takes it from there "
                         f"wherever generation_kwargs does not set {name}. To train, {_turn_off(name, off, source)}.")
    changes = _model_fields(SAMPLING_CHANGES, gen_config, kwargs, trl_sets)
    if changes:
        logger.warning(
            "The %s changes the distribution completions are sampled from (transformers' generate takes every field "
            "TRL's generation config leaves unset from it; TRL samples with them too), while the loss scores them "
            "under softmax(logits / temperature): %s. grpotrl's sampler/trainer gap measures their effect where the "
            "sampler's logprobs are recorded (hf_importance_sampling_correction corrects the update for it).", where,
            "; ".join(f"{name}={value!r} {what} (to sample without it, {_turn_off(name, off, source)})"
                      for name, (value, what, off) in changes.items()))
    model_min = getattr(gen_config, "min_new_tokens", None)
    if isinstance(model_min, int) and model_min > 0 and model_min != args.min_new_tokens:
        logger.warning("min_new_tokens=%d in the %s is not applied: on this path grpotrl's min_new_tokens (now %d) "
                       "is the one setting, blocking every stop id, with its rate logged. Set min_new_tokens=%d to "
                       "keep the model's.", model_min, where, args.min_new_tokens, model_min)


CAGRAD_REENTRANT_ERROR = (
    "cagrad={mode!r} takes each task's gradient with torch.autograd.grad, which reentrant activation checkpointing "
    "(activation_checkpointing_kwargs={kwargs!r}) does not support: its layers run their forward without a graph "
    "to their parameters, so no task gradient reaches them. Set activation_checkpointing_kwargs: "
    "{{use_reentrant: false}} (transformers' default), turn activation_checkpointing off, or use cagrad: off.")


def check_tasks(reward_funcs, args, train_dataset, eval_dataset) -> None:
    """``MultiTaskGRPOTrainer``'s checks, within GRPO's once the rewards are known: every row labelled
    in ``task_column``, every label with reward functions, what CAGrad needs (no ``cagrad_c`` without it, no
    reentrant activation checkpointing, under which its per-task ``autograd.grad`` reaches no parameter).
    GRPO's then check each task's reward columns on its own rows and turn the mapping into TRL's flat list
    (``rewards.tasks.per_task``)."""
    column = args.task_column
    for name, ds in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        for d in datasets_of(ds):
            if column not in (getattr(d, "column_names", None) or []):
                raise InputError(f"{name} has no {column!r} column (columns: {getattr(d, 'column_names', None)}): "
                                 f"MultiTaskGRPOTrainer needs a task label per row; set task_column to the column "
                                 "that holds it.")
    labels = task_labels(column, train_dataset, eval_dataset)
    if not labels:
        raise InputError("MultiTaskGRPOTrainer needs a map-style dataset (datasets.Dataset) to read its task labels.")
    if args.scale_rewards == "batch":
        raise InputError("scale_rewards='batch' divides every advantage by one std over the whole batch, which "
                         "mixes tasks; use scale_rewards: group (the default) or none.")
    if args.cagrad == "off" and args.cagrad_c != 0.5:
        raise InputError(f"cagrad_c={args.cagrad_c} with cagrad='off': the plain summed loss would ignore it. Set "
                         "cagrad: exact (or low_memory) to combine the task gradients with CAGrad, or drop cagrad_c.")
    if args.cagrad != "off":
        checkpointing = args.activation_checkpointing_kwargs or args.gradient_checkpointing_kwargs or {}
        if ((args.activation_checkpointing or args.gradient_checkpointing) and isinstance(checkpointing, dict)
                and checkpointing.get("use_reentrant")):  # autograd.grad finds no graph to the parameters
            raise InputError(CAGRAD_REENTRANT_ERROR.format(mode=args.cagrad, kwargs=checkpointing))
        if len(labels) < 2:
            raise InputError(f"cagrad={args.cagrad!r} combines per-task gradients, but the data has one task "
                             f"({labels}); use cagrad: off.")
        if sharded_launch(args):  # the config's or `accelerate launch`'s
            raise InputError(CAGRAD_DISTRIBUTED_ERROR.format(mode=args.cagrad))
        if args.use_liger_kernel:
            raise InputError("cagrad needs TRL's _compute_loss (use_liger_kernel=True bypasses it); turn one off.")
    missing = [t for t in labels if t not in {str(k) for k in reward_funcs}] if isinstance(reward_funcs, Mapping) \
        else []  # a list: the same functions for every task
    if missing:
        raise InputError(f"task(s) {missing} in the data have no reward functions: reward_funcs has "
                         f"{list(reward_funcs)}. Add an entry for each task (or drop those rows).")


# ---------------------------------------------------------------------------------------------
# GAD
# ---------------------------------------------------------------------------------------------

def check_teacher_responses(dataset, split: str = "train") -> None:
    """GAD rows need a non-empty ``teacher_response`` string and a chat-message ``prompt``."""
    if dataset is None or not hasattr(dataset, "column_names"):
        return
    if "teacher_response" not in dataset.column_names:
        raise InputError(
            f"GAD needs a 'teacher_response' column (the teacher's answer as text), but the {split!r} split has "
            f"columns {dataset.column_names}. A row looks like {{\"prompt\": [{{\"role\": \"user\", \"content\": "
            "\"What is 7 + 5?\"}], \"teacher_response\": \"12\"}. Add the column or map your rows into that shape."
        )
    for i, (prompt, text) in enumerate(zip(dataset["prompt"], dataset["teacher_response"])):
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"Row {i} of the {split!r} split has teacher_response={text!r}; GAD needs the "
                             "teacher's answer as a non-empty string. Fix or drop that row.")
        if not isinstance(prompt, list):
            raise InputError(f"Row {i} of the {split!r} split has a {type(prompt).__name__} prompt; GAD scores "
                             "teacher and student through the chat template (I9), so prompts must be chat messages.")


def teacher_responses_over_cap(dataset, tokenizer, max_completion_length: int | None,
                               split: str = "train") -> str | None:
    """A warning when teacher responses of ``dataset`` are longer than the student can ever finish: more
    than ``max_completion_length`` tokens with the end-of-turn token that ends them (the response text
    tokenized alone, as the student would generate it). The student is cut at the cap and never ends such a
    response, the teacher's always ends, so D can tell them apart by length alone. None when every response
    fits, or the dataset cannot be read by column (an IterableDataset)."""
    if not max_completion_length or dataset is None or "teacher_response" not in (
            getattr(dataset, "column_names", None) or []) or not hasattr(dataset, "__getitem__"):
        return None
    texts = list(dataset["teacher_response"])
    lengths = [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]  # + end-of-turn
    over = [i for i, n in enumerate(lengths) if n > max_completion_length]
    if not over:
        return None
    longest = max(lengths)
    return (f"{len(over)} of {len(lengths)} teacher responses in the {split!r} split ({len(over) / len(lengths):.0%}) "
            f"are longer than max_completion_length={max_completion_length} tokens with their end-of-turn token "
            f"(longest {longest}, e.g. row {over[0]}: {lengths[over[0]]}). The student is cut at "
            f"{max_completion_length} tokens and never ends such a response, while the teacher's always ends, so the "
            f"discriminator can tell them apart by length alone. Raise max_completion_length (to {longest} for "
            f"every response), or drop those rows: dataset.filter(lambda r: len(tokenizer(r['teacher_response'], "
            f"add_special_tokens=False)['input_ids']) < {max_completion_length}).")


class GADCheck(NamedTuple):
    """What ``check_gad`` hands ``GADTrainer.__init__``:

    * ``discriminator_load``: how D loads besides its path (``discriminator_load_kwargs``);
    * ``student_adapter``: the lookup of the student's PEFT adapter, where one was made (D starts from the student's
      checkpoint by name; None otherwise), which the trainer hands GRPO's checks (``ADAPTER_LOOKUP``) so that they
      ask no second time.
    """

    discriminator_load: dict
    student_adapter: AdapterLookup | None


def check_gad(model, args, train_dataset, eval_dataset, kwargs: dict) -> GADCheck:
    """``GADTrainer``'s own checks, before GRPO's: its config, no reward functions or tools, no FSDP,
    every row with the teacher's response, the discriminator's starting point. Returns a ``GADCheck`` (a
    student's PEFT adapter looked up once here, for D and for GRPO's checks; ``kwargs[ADAPTER_LOOKUP]``, the CLI's,
    taken at the same name and revision instead of asking again)."""
    if not isinstance(args, GADConfig):
        raise InputError(f"GADTrainer needs a grpotrl.GADConfig, got {type(args).__name__}: GAD has no TRL "
                         "counterpart, and its config holds the discriminator's settings and GSPO's defaults "
                         "(importance_sampling_level='sequence', loss_type='grpo', its clip range), which a "
                         "GRPO config would silently replace with TRL's token-level ones.")
    if "reward_funcs" in kwargs:
        raise InputError("GADTrainer's reward is its discriminator; it takes no reward_funcs.")
    if kwargs.get("tools") or kwargs.get("environment_factory"):
        raise InputError("GAD scores one plain-text response per prompt; tools and environments are not supported.")
    if sharded_launch(args) == "FSDP":  # the config's or `accelerate launch`'s: before anything loads
        raise InputError("GADTrainer with FSDP is not supported (the discriminator is prepared for DDP or "
                         "DeepSpeed). Use DeepSpeed ZeRO (recipes/accelerate/zero2.yaml, zero3.yaml) or DDP.")
    for name, ds in named_splits(train_dataset, eval_dataset):
        check_dataset(ds, name, kind="grpo")  # GRPO's rows first (found checked by GRPO's preflight)
        check_teacher_responses(ds, name)
    return _check_discriminator(model, args, kwargs.get(ADAPTER_LOOKUP))


def discriminator_load_kwargs(model, args) -> dict:
    """How D loads besides its path, as TRL loads the student and reward models: ``trust_remote_code``
    (``model_init_kwargs``' own, else ``args.trust_remote_code``) and, where D starts from the student's
    checkpoint by name, the student's ``model_init_kwargs["revision"]`` (a loaded student's revision is
    unknown: its config's path at the default revision). Where that checkpoint is a PEFT adapter (a LoRA SFT's
    output), D loads the adapter's base (its path: the student's base model's) at the base's revision
    (``revision``: the adapter's record) and merges the adapter into it (``adapter``, the ``PeftAdapter`` read at
    the student's revision: ``gad.discriminator.merged_adapter``); else ``adapter`` is None."""
    return _discriminator_load(model, args)[0]


def _discriminator_load(model, args, given: AdapterLookup | None = None) -> tuple[dict, AdapterLookup | None]:
    """``(discriminator_load_kwargs, the student's adapter lookup)``: the lookup made once (None: none needed),
    ``given`` where it was made for the same name and revision (the CLI's)."""
    init = args.model_init_kwargs or {}
    own_path = args.discriminator_model_name_or_path or not isinstance(model, str)
    lookup = None
    if not own_path:
        name, revision = resolve_model_path(model), init.get("revision")
        asked = given is not None and (given.name, given.revision) == (name, revision)
        lookup = given if asked else AdapterLookup(name, revision, find_adapter(name, revision))
    adapter = lookup.adapter if lookup else None
    return {"revision": None if own_path else adapter.base_revision if adapter else init.get("revision"),
            "trust_remote_code": init.get("trust_remote_code", args.trust_remote_code),
            "adapter": adapter}, lookup


def _check_discriminator(model, args, given: AdapterLookup | None = None) -> GADCheck:
    """D's starting point: ``discriminator_model_name_or_path`` (an alias resolved in ``args``), else the
    student's own checkpoint at the student's revision (``discriminator_load_kwargs``), which must then be
    loadable by name; a student's PEFT adapter, its base model (at the base's revision), the adapter merged into
    D after the load (``gad.discriminator.merged_adapter``). That merge is refused where it cannot be made: a
    prompt-learning adapter (no weights to merge), and under DeepSpeed ZeRO-3, where D's weights load
    partitioned (transformers' ``zero.Init``) and PEFT merges only whole weights. ``given``: an earlier lookup of
    the student (``_discriminator_load``). Returns ``check_gad``'s ``GADCheck``."""
    if args.discriminator_model_name_or_path:
        args.discriminator_model_name_or_path = resolve_model_path(args.discriminator_model_name_or_path)
        check_discriminator_source(args.discriminator_model_name_or_path)
        return GADCheck(*_discriminator_load(model, args, given))
    student_source = resolve_model_path(model) if isinstance(model, str) else \
        getattr(getattr(model, "config", None), "_name_or_path", None)
    if not student_source:
        raise InputError("Cannot initialise the discriminator: the student model has no name or path. Set "
                         "discriminator_model_name_or_path (a local directory or a Hub id).")
    load, lookup = _discriminator_load(model, args, given)
    adapter = load["adapter"]
    if adapter is None:
        check_model_source(student_source, load["revision"], what="Discriminator model (the student's own checkpoint)")
        return GADCheck(load, lookup)
    from transformers.integrations import is_deepspeed_zero3_enabled

    path = adapter.name
    peft_config = adapter.peft_config()  # the config read once (find_adapter), as PEFT reads it
    why = ("it is a prompt-learning adapter, which holds no weights to merge"
           if peft_config.is_prompt_learning or peft_config.is_adaption_prompt else
           "this run is under DeepSpeed ZeRO-3, where the discriminator's weights load partitioned and PEFT merges "
           "only whole weights" if is_deepspeed_zero3_enabled() else None)
    if why is not None:
        raise InputError(
            f"The discriminator starts from the student's checkpoint {path!r}, a PEFT adapter "
            f"({adapter.config.get('peft_type')}) that it would load merged into its base model, and {why}. To start "
            f"it from this policy, {merge_advice(path)} as the student, or keep the adapter as the student and set "
            "discriminator_model_name_or_path: MERGED; or set discriminator_model_name_or_path to another checkpoint.")
    check_model_source(adapter.base, load["revision"],
                       what="Discriminator model (the base model of the student's PEFT adapter)")
    return GADCheck(load, lookup)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------

class SFTCheck(NamedTuple):
    """What ``check_sft`` hands ``SFTTrainer.__init__``:

    * ``model``, ``processing_class``, ``stop_token_ids``, ``checked_resume``, ``adapter``: as ``GRPOCheck``'s (the
      tokenizer loaded with TRL's default sides);
    * ``data_format``: TRL's dataset type of the train rows (``chat.sft_rows.data_format``: "chat_prompt_completion",
      "chat", ...; None under a ``formatting_func`` or for rows it cannot read).
    """

    model: object
    processing_class: object
    stop_token_ids: list[int]
    data_format: str | None
    checked_resume: ResumeCheck
    adapter: PeftAdapter | None


def check_sft(model, processing_class, args, train_dataset, eval_dataset, kwargs: dict) -> SFTCheck:
    """Every check of ``SFTTrainer.__init__`` before TRL loads anything: the datasets as TRL takes
    them, ``padding_free`` without packing under ``max_length``, model and tokenizer, and on chat data a
    template, the checkpoint's fingerprint (the rows rendered as TRL will render them, compared with the rendering
    the checkpoint was trained on: ``templates.check_rows_render_alike``) and I2 on the first prompt-completion row.
    ``kwargs[ADAPTER_LOOKUP]``, where a step before the trainer looked the model up (the CLI's), is that answer
    (``prepare_model_and_tokenizer``'s ``adapter_lookup``). Returns an ``SFTCheck``."""
    formatting_func = kwargs.get("formatting_func")
    dataset_kwargs = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
    skip_prepare = bool(dataset_kwargs.get("skip_prepare_dataset"))
    for name, dataset in named_splits(train_dataset, eval_dataset):
        check_dataset(dataset, name, kind="sft", text_field=args.dataset_text_field,
                      formatting_func=formatting_func, skip_prepare=skip_prepare,
                      completion_only_loss=args.completion_only_loss)
    row = first_row(train_dataset) or {}
    if args.padding_free and not args.packing and args.max_length is not None \
            and "image" not in row and "images" not in row:  # TRL's condition; vision rows it refuses otherwise
        raise InputError(
            f"When `padding_free=True` without packing, `max_length` is not enforced, and max_length="
            f"{args.max_length} is set (SFTConfig's default is 1024; TRL refuses this once the model has loaded). "
            "Set `max_length: null` (rows then keep their length: truncate them beforehand), or `packing: true` "
            "(e.g. with packing_strategy 'bfd', as TRL suggests), or drop padding_free."
        )
    model, processing_class, stop_ids, model_id, adapter = prepare_model_and_tokenizer(
        model, processing_class, args, None, kind="sft", peft_config=kwargs.get("peft_config"),
        quantization_config=kwargs.get("quantization_config"), adapter_lookup=kwargs.get(ADAPTER_LOOKUP))
    fmt = None if formatting_func is not None else data_format(train_dataset)
    i2 = fmt == "chat_prompt_completion" and args.completion_only_loss is not False and not skip_prepare
    if fmt in ("chat_prompt_completion", "chat") and args.chat_template_path is None:  # else TRL installs one later
        templates.require_chat_template(processing_class)
        if model_id and sft_option(args, "check_template"):  # the rows as TRL renders them (with TRL's variant)
            row_template = assistant_only_template(processing_class, stop_ids) if args.assistant_only_loss else None
            templates.check_fingerprint(model_id, processing_class,  # SFT trains the tokens it adds
                                        revision=(args.model_init_kwargs or {}).get("revision"),
                                        vocabulary_may_grow=True, rows=None if skip_prepare else train_dataset,
                                        row_template=row_template, row_kwargs=sft_option(args, "chat_template_kwargs"))
        if i2 and not args.assistant_only_loss:  # I2 on the first row, before any weights load
            tokenize_i2_row(first_row(train_dataset), processing_class, stop_ids, sft_option(args, "chat_template_kwargs"))
    resume = check_resume(args, "sft", processing_class, _uses_peft(model, kwargs.get("peft_config"), adapter),
                          model=model, peft_config=kwargs.get("peft_config"), adapter=adapter)
    return SFTCheck(model, processing_class, stop_ids, fmt, resume, adapter)
