"""``grpotrl sft|grpo|gad --config recipe.yaml [--key value ...]``: straight-line glue, no logic.

    grpotrl sft  --config recipes/smollm2/sft_quickstart.yaml
    grpotrl grpo --config recipes/smollm2/grpo_quickstart.yaml --max_steps 5
    grpotrl gad  --config recipes/smollm2/gad_quickstart.yaml
    grpotrl report outputs/smollm2-grpo-quickstart   # PNG plots from trainer_state.json
    python -m grpotrl.cli grpo --config recipes/smollm2/grpo_quickstart.yaml
    accelerate launch --config_file recipes/accelerate/single.yaml -m grpotrl.cli grpo --config ...

A recipe is a flat YAML mapping of fields of three dataclasses: ``ScriptArguments`` /
``GRPOScriptArguments`` below (dataset, rewards, judges: the field names of TRL's own scripts
plus ``judges``), ``trl.ModelConfig`` (model, PEFT) and ``grpotrl.SFTConfig`` / ``GRPOConfig`` /
``GADConfig`` (everything ``TrainingArguments`` and TRL know). ``--key value`` on the command
line overrides the recipe (``--judges`` takes JSON). A key that no dataclass knows is an error,
with the closest known names; so is a value its field's type cannot hold, an ``env:`` variable
that libraries read at import, before the recipe (``recipe_types``), a key the recipe sets twice and
a flag the command line gives twice (YAML and argparse would keep the last silently).

Order, as open-r1's ``grpo.py``: parse (every key and value type) -> the model path and its load
settings (``model_init_kwargs``; the recipe's quantization needs LoRA; a PEFT adapter as the model, such as a
LoRA SFT's output, is trained on with ``use_peft: true`` and its own LoRA settings) -> the dataset splits and
the reward names and judges (parsed, not resolved) -> the output dir (locked: one run at a time;
then checked: nothing replaced unless asked) -> the trainer, whose
preflight (``grpotrl/preflight/``) checks rows, model, tokenizer, chat template, stop tokens,
rewards (names resolved, the columns they read) and the resume checkpoint, once, before TRL loads
the model and before any local judge is loaded; so bad input costs seconds, not a model load.
Datasets and models are what ``trl grpo`` takes: a Hub id goes to ``datasets`` / ``transformers``
unchanged and is downloaded and cached by them (offline, read from their cache), so grpotrl
downloads what TRL would, nothing more; shipped datasets (``quickstart``, ``multitask``,
``gad_toy``) and local files need no network. Rewards are named
(``rewards.resolve.resolve_reward_funcs``: the recipe's judges, grpotrl's and TRL's built-ins,
dotted import paths, ``task:name`` per task, which trains with ``MultiTaskGRPOTrainer``, as does
``cagrad``) or a ``reward_model_name_or_path``; judges are declared in the recipe
(``grpotrl.rewards.recipe``).
"""

from __future__ import annotations

import grpotrl  # noqa: I001  first: sets OMP_WAIT_POLICY before torch is imported

import difflib
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field

# No module here imports torch, transformers or TRL (``import grpotrl`` imports none either): they are imported
# inside main()'s Ctrl-C handling, so Ctrl-C while they load is its one line and exit 130, not a traceback.
from grpotrl.errors import HealthStop, InputError
from grpotrl.rewards.resolve import REWARD_FUNCS

COMMANDS = ("sft", "grpo", "gad")
USAGE = "usage: grpotrl {sft,grpo,gad} --config RECIPE.yaml [--key value ...]\n       grpotrl report OUTPUT_DIR [--out DIR]"


@dataclass
class ScriptArguments:
    """The dataset fields of ``trl.ScriptArguments``, by the same names (its streaming and
    bias-buffer switches are left out: grpotrl checks every row before training).
    ``overwrite_output_dir`` is a field of grpotrl's configs (transformers 5 dropped it from
    ``TrainingArguments``), so TrlParser scripts built on them parse it too."""

    dataset_name: str = field(
        default="quickstart",
        metadata={"help": "A dataset shipped with grpotrl (`quickstart`, `multitask`, `gad_toy`), a folder written by "
                  "`save_to_disk`, or anything `datasets.load_dataset` takes, handed to it unchanged: a local "
                  ".json/.jsonl/.parquet/.csv file (its rows are the 'train' split) or a folder of them (splits "
                  "from the file names, e.g. train.jsonl, test.jsonl), or a Hugging Face Hub dataset id "
                  "(downloaded and cached by `datasets`; offline, from its cache)."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (the `name` argument of `datasets.load_dataset`)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split to evaluate on when eval_strategy != 'no'."}
    )


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions, each a name looked up in this order: a judge of `judges`; grpotrl's "
                  f"{list(REWARD_FUNCS)} (grpotrl/rewards/rules.py); TRL's `trl grpo` names "
                  "(accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment); a "
                  "dotted import path to your own function (my_lib.rewards.custom_reward; the working directory "
                  "and PYTHONPATH are searched). As task:name (every entry) for rewards per task, e.g. "
                  "hallucination:exact_answer fairness:fair_judge (MultiTaskGRPOTrainer, rows labelled in "
                  "task_column)."},
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A sequence-classification reward model (local directory or Hub id) scoring every row, "
                  "before the reward_funcs, as in `trl grpo`. Not with per-task rewards."},
    )
    judges: dict | str | None = field(
        default=None,
        metadata={"help": "LLM judges by name, for reward_funcs: a mapping name -> settings. An HTTP judge "
                  "(OpenAI-compatible server) has base_url, model, rubric and optionally api_key_env (the NAME of "
                  "the environment variable holding the key; a key itself is refused), max_concurrency, timeout, "
                  "max_retries, backoff, max_tokens, temperature, max_failed_batches, cache_size, max_reply_bytes, rubric_columns. A "
                  "local judge has model_path, rubric and optionally batch_size, rubric_columns. rubric: fairness, "
                  "hallucination, a .yaml/.json/.txt rubric file or the criterion as text; rubric_columns maps the "
                  "rubric's template fields to dataset columns ({reference: answer}). On the command line: JSON. "
                  "See grpotrl/rewards/recipe.py and recipes/smollm2/grpo_multitask_judges.yaml."},
    )


def make_parser(command: str):
    from trl import ModelConfig, TrlParser

    # allow_abbrev=False: argparse would otherwise take `--num_generation` for `--num_generations`
    if command == "sft":
        return TrlParser((ScriptArguments, grpotrl.SFTConfig, ModelConfig), prog="grpotrl sft", allow_abbrev=False)
    if command == "gad":
        return TrlParser((ScriptArguments, grpotrl.GADConfig, ModelConfig), prog="grpotrl gad", allow_abbrev=False)
    return TrlParser((GRPOScriptArguments, grpotrl.GRPOConfig, ModelConfig), prog="grpotrl grpo", allow_abbrev=False)


def parse_args(command: str, argv: list[str]):
    """``(script_args, training_args, model_args)`` from ``--config`` YAML (read with
    ``yaml.safe_load`` by ``TrlParser``; ``--config=PATH`` too) and ``--key value`` overrides."""
    if command not in COMMANDS:
        raise InputError(f"Unknown command {command!r}; use one of {list(COMMANDS)}. {USAGE}")
    # `--config=recipe.yaml` as argparse takes any `--key=value` (TrlParser looks for `--config` alone)
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    if argv.count("--config") > 1:
        raise InputError("--config is given more than once: pass one recipe, and override its keys with --key value.")
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise InputError("--config needs a recipe YAML file after it, got nothing. See recipes/smollm2/ for "
                             "examples.")
        given = argv[i + 1]
        if not os.path.exists(given):
            raise InputError(f"--config {given}: no such file (looked in {os.path.abspath(given)}). Check the path; "
                             "see recipes/smollm2/ for examples.")
        if not os.path.isfile(given):
            raise InputError(f"--config {given}: not a file (a directory?). Give the recipe YAML file itself, e.g. "
                             "recipes/smollm2/grpo_quickstart.yaml.")
    from grpotrl.configs import recipe_types

    parser = make_parser(command)
    recipe_types.take_false_from_command_line(parser)  # --trackio_static_space_id false: False, not 'false'
    parser.error = _argparse_error  # one `grpotrl CMD: error:` line instead of argparse's usage block
    _refuse_repeated_flags(argv, parser._option_string_actions)
    if "--config" in argv:  # YAML syntax, env: variables read at import, each value against its field's type
        recipe = argv[argv.index("--config") + 1]  # (argparse converts strings only)
        settings = recipe_types.read_recipe(recipe)
        recipe_types.check_recipe_env(settings, recipe)
        recipe_types.check_recipe_types(settings, parser.dataclass_types, recipe)
    try:
        *dataclasses, from_config, from_argv = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except InputError:
        raise
    except ValueError as err:  # a config's own check (e.g. ModelConfig: load_in_4bit and load_in_8bit)
        raise InputError(f"Invalid settings: {err} Fix the recipe or the command line; `grpotrl {command} "
                         "--help` describes every key.") from None
    known = {action.dest for action in parser._actions}
    if from_config:
        recipe = argv[argv.index("--config") + 1]
        raise InputError(f"Unknown key(s) in the recipe {recipe}: {_with_hints(from_config[::2], known)}. "
                         f"Fix the spelling or remove them; `grpotrl {command} --help` lists every key.")
    if from_argv:
        flags = [a for a in from_argv if a.startswith("-")] or from_argv
        raise InputError(f"Unknown command-line argument(s): {_with_hints(flags, known)}. "
                         f"`grpotrl {command} --help` lists every key.")
    for args in dataclasses:
        _single_module_names_listed(args)
    return tuple(dataclasses)


# ModelConfig's list fields that PEFT matches module or parameter names against
_PEFT_NAME_LISTS = ("lora_target_modules", "lora_modules_to_save", "lora_target_parameters")


def _single_module_names_listed(args) -> None:
    """A single module name in a PEFT list field made a list again: ``lora_target_modules: q_proj``,
    ``[q_proj]`` or ``--lora_target_modules q_proj`` reach ``ModelConfig`` as the string 'q_proj' (a recipe's
    string is not split by argparse; ModelConfig turns a one-item list into its item), which PEFT takes as a
    regex that must match a module's whole dotted name, so 'q_proj' matched nothing and the run failed after
    the model loaded (NoMatchingPeftModuleError). A name (letters, digits, ``_ - .``) is a list of that name,
    matched as two names are; 'all-linear' and regular expressions stay strings, as PEFT reads them. Only with
    ``use_peft``: without it no adapter is built and the preflight refuses the lora_* settings as written."""
    if not getattr(args, "use_peft", False):  # no adapter is built: the lora_* settings are refused as given
        return
    for name in _PEFT_NAME_LISTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and re.fullmatch(r"[\w.-]+", value) and value.lower() != "all-linear":
            setattr(args, name, [value])


def _refuse_repeated_flags(argv: list[str], actions: dict) -> None:
    """Raise ``InputError`` naming every setting that ``argv`` gives more than once, by any of its flags
    (``--max_steps``, ``--max-steps``, ``--no_gradient_checkpointing``; ``actions``: the parser's flag ->
    action). argparse keeps the last silently, so ``--reward_funcs exact_answer --reward_funcs format`` trained
    on ``format`` alone. The command line overriding the recipe is no repeat; values are not shown (tokens)."""
    given: dict[str, list[str]] = {}
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag in actions:
            given.setdefault(actions[flag].dest, []).append(flag)
    repeated = [f"{dest} ({', '.join(flags)})" for dest, flags in given.items() if len(flags) > 1]
    if repeated:
        raise InputError(f"Set more than once on the command line: {'; '.join(repeated)}. argparse would keep the "
                         "last silently; give each once (a list takes all its values after one flag: --reward_funcs "
                         "exact_answer format). A flag given once already overrides the recipe's value.")


def _argparse_error(message: str):
    message = message.rstrip().rstrip(".")  # argparse's own messages end in a period or not
    raise InputError(f"{message[:1].upper()}{message[1:]}{_int_hint(message)}. `--help` describes every key.")


def _int_hint(message: str) -> str:
    """How to write the value of an argparse ``invalid int value: '...'`` message: ``' (write 1000)'`` for
    ``'1e3'`` or ``'1000.0'``; for ``'null'`` / ``'None'``, that leaving the flag out keeps the recipe's value
    or the default; '' for any other message or value.

    >>> _int_hint("argument --max_steps/--max-steps: invalid int value: '1e3'")
    ' (write 1000)'
    >>> _int_hint("argument --max_steps/--max-steps: invalid int value: 'null'")
    " (no value: leave --max_steps out to keep the recipe's value or the default)"
    """
    found = re.search(r"argument (--[\w-]+)\S*: invalid int value: '(.*)'$", message)
    if not found:
        return ""
    from grpotrl.configs.recipe_types import whole_number

    flag, value = found.groups()
    if value.lower() in ("null", "none", "~"):
        return f" (no value: leave {flag} out to keep the recipe's value or the default)"
    return "" if (whole := whole_number(value)) is None else f" (write {whole})"


def _with_hints(keys: list[str], known: set[str]) -> str:
    """``'lerning_rate' (did you mean 'learning_rate'?)`` for each key that has a close known one."""
    out = []
    for key in keys:
        name = key.lstrip("-").split("=")[0]
        close = difflib.get_close_matches(name, sorted(known), n=3)
        out.append(f"{name!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(name))  # no value
    return ", ".join(out)


def run(command: str, argv: list[str]) -> None:
    script_args, training_args, model_args = parse_args(command, argv)

    import transformers
    from trl import get_peft_config, get_quantization_config

    from grpotrl.checkpoints import check_output_dir
    from grpotrl.data import load_splits, pick_split
    from grpotrl.models import resolve_model_path
    from grpotrl.preflight import ADAPTER_LOOKUP
    from grpotrl.preflight.model import check_model_args
    from grpotrl.rewards.recipe import parse_judges
    from grpotrl.rewards.resolve import RewardNames
    from grpotrl.checkpoints.run_lock import lock_output_dir, release_output_dir

    ################
    # Model path and its load settings: the trainer loads it, after its preflight (grpotrl/preflight/)
    ################
    model_path = resolve_model_path(model_args.model_name_or_path)  # an alias, a local dir or a Hub id
    # the recipe's quantization needs LoRA; LoRA targets exist; a PEFT adapter as the model (a LoRA SFT's output)
    # is trained on with its own settings, which the recipe's LoRA fields must not contradict. The lookup of the
    # model's adapter_config.json (an adapter or not; on a Hub id a request) goes to the trainer's preflight,
    # which takes it at the same name and revision instead of asking again
    lookup = check_model_args(model_args, model_path, getattr(training_args, "disable_dropout", False))
    is_adapter = lookup is not None and lookup.adapter is not None
    training_args.model_init_kwargs = {  # as `trl grpo` sets them; device_map None: the Trainer places the model
        "revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype, "device_map": None,
        **(training_args.model_init_kwargs or {}),
    }

    ################
    # Datasets, rewards and judges (HTTP judges built, local ones checked: they load after every check)
    ################
    splits = load_splits(script_args.dataset_name, script_args.dataset_config)
    train_dataset = pick_split(splits, script_args.dataset_train_split, script_args.dataset_name)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = pick_split(splits, script_args.dataset_test_split, script_args.dataset_name)
    rewards = {}  # GAD's reward is its discriminator, loaded by the trainer; SFT has none
    if command == "grpo":  # names resolved by the trainer's preflight, after the model and rows passed
        rewards["reward_funcs"] = RewardNames(script_args.reward_funcs, parse_judges(script_args.judges),
                                              script_args.reward_model_name_or_path)

    ################
    # Output dir: one run at a time (a second is refused, naming the first; held until trainer.end(), until
    # train() raises, or exit), and nothing of an earlier run is replaced unless asked: overwrite, or resume a
    # checkpoint inside it (the trainer checks the resume checkpoint)
    ################
    lock_output_dir(training_args.output_dir, training_args.process_index, training_args.world_size)
    try:
        check_output_dir(training_args.output_dir, resume=training_args.resume_from_checkpoint,
                         overwrite=training_args.overwrite_output_dir)
    except InputError:
        release_output_dir(training_args.output_dir)  # refused: output_dir is left as it was found
        raise

    ################
    # Trainer: its preflight checks model, tokenizer, data, rewards and resume checkpoint, then TRL loads
    ################
    transformers.set_seed(training_args.seed)
    trainer_cls = {"sft": grpotrl.SFTTrainer, "grpo": grpotrl.GRPOTrainer, "gad": grpotrl.GADTrainer}[command]
    if command == "grpo" and (rewards["reward_funcs"].by_task or training_args.cagrad != "off"):
        trainer_cls = grpotrl.MultiTaskGRPOTrainer  # rewards per task, CAGrad
    looked_up = {} if lookup is None else {ADAPTER_LOOKUP: lookup}  # GAD's D takes it too (preflight.check_gad)
    trainer = trainer_cls(
        model=model_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=None if is_adapter else get_peft_config(model_args),
        **rewards,
        **looked_up,
    )

    ################
    # Train, save, summarize
    ################
    try:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint,  # checked by preflight
                               overwrite_output_dir=True)  # the output dir was checked above
    except KeyboardInterrupt:  # Ctrl-C: say where the run stands instead of a traceback from inside torch
        raise KeyboardInterrupt(interrupted(training_args.output_dir, trainer.state.global_step)) from None
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the whole log history, beside the weights
    try:  # the run is saved: nothing below may turn it into a failure or skip trainer.end()
        runtime = (result.metrics or {}).get("train_runtime")
        trainer.accelerator.print(summary(command, trainer.state.log_history))
        trainer.accelerator.print(
            f"grpotrl {command}: {trainer.state.global_step} steps"
            + (f" in {runtime:.0f} s" if _number(runtime) else "")
            + f", stop ids {getattr(trainer, 'stop_token_ids', '?')}; model, tokenizer, "
            f"template fingerprint and trainer_state.json in {training_args.output_dir}"
        )
    finally:
        trainer.end()


def summary(command: str, log_history: list[dict], window: int = 5) -> str:
    """Mean of the first and last ``window`` logged values of the metrics that tell progress; with fewer
    than ``2 * window`` values, of the first and last half, so the two never share a value.
    NaN is TRL's "no row scored" and is left out like None; +-inf is no number to average either:
    it is left out and counted, and a metric that was never finite says so instead of printing ``inf``.

    >>> summary("sft", [{"loss": 2.0}, {"loss": 1.0}, {"loss": 0.5}], window=1)
    'loss: 2.000 (first 1 steps) -> 0.500 (last 1 steps)'
    >>> summary("sft", [{"loss": 4.0}, {"loss": 3.0}, {"loss": 2.0}, {"loss": 1.0}])  # 4 logs: halves, not all 4 twice
    'loss: 3.500 (first 2 steps) -> 1.500 (last 2 steps)'
    >>> summary("grpo", [{"reward": None}, {"reward": 0.5}, {"reward": "n/a"}])  # a step whose judges scored no row
    'reward: 0.500 (first 1 steps) -> 0.500 (last 1 steps)'
    >>> summary("grpo", [{"reward": float("inf")}, {"reward": 0.5}, {"reward": float("nan")}])
    'reward: 0.500 (first 1 steps) -> 0.500 (last 1 steps); 1 logged value not finite (inf), left out'
    >>> summary("grpo", [{"reward": float("inf")}, {"reward": float("-inf")}])
    'reward: not finite at any of the 2 logged steps (inf, -inf): nothing to average'
    >>> summary("sft", [{"train_runtime": 3.1, "train_loss": 2.5}])  # max_steps < logging_steps
    'no metric logged at a logging step (the run ended before its first logging_steps); train_loss over the run: 2.500'
    """
    keys = {"sft": ["loss"], "gad": ["gad/d_acc", "gad/student_score", "gad/teacher_score", "completions/mean_length"]
            }.get(command, ["reward", "rewards/exact_answer_reward/mean", "completions/mean_length"])
    lines = []
    for key in keys:  # None, NaN: no row scored; anything but a number (a string, a list) is left out too
        logged = [entry[key] for entry in log_history if isinstance(entry, dict) and _real(entry.get(key))]
        values = [v for v in logged if _number(v)]
        odd = [v for v in logged if math.isinf(v)]
        kinds = ", ".join(dict.fromkeys(str(float(v)) for v in odd))
        if values:
            n = min(window, max(1, len(values) // 2))
            first, last = values[:n], values[-n:]
            lines.append(f"{key}: {sum(first) / len(first):.3f} (first {len(first)} steps) -> "
                         f"{sum(last) / len(last):.3f} (last {len(last)} steps)"
                         + (f"; {len(odd)} logged value{'s' * (len(odd) > 1)} not finite ({kinds}), left out"
                            if odd else ""))
        elif odd:
            lines.append(f"{key}: not finite at any of the {len(odd)} logged steps ({kinds}): nothing to average")
    if lines:
        return "\n".join(lines)
    final = [e["train_loss"] for e in log_history if isinstance(e, dict) and _number(e.get("train_loss"))]
    return ("no metric logged at a logging step (the run ended before its first logging_steps)"
            + (f"; train_loss over the run: {final[-1]:.3f}" if final else ""))


def _real(value) -> bool:
    """A number, finite or not (not a bool, None or a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value) -> bool:
    """A finite number: not NaN, not +-inf."""
    return _real(value) and math.isfinite(value)


def interrupted(output_dir: str, step: int) -> str:
    """What a run stopped by Ctrl-C at ``step`` left in ``output_dir`` and how to go on from it: the
    checkpoint ``resume_from_checkpoint: true`` would continue (``find_last_checkpoint``), or why none."""
    from grpotrl.checkpoints import find_last_checkpoint

    try:
        last = find_last_checkpoint(output_dir)
    except InputError as err:  # none saved yet, only an earlier run's, or the newest cut short (Ctrl-C while saving)
        if os.path.isdir(output_dir) and any(n.startswith("checkpoint-") for n in os.listdir(output_dir)):
            return f"at step {step}; {err}"  # names the checkpoint and what to do"
        return (f"at step {step}; no checkpoint of this run to resume in {output_dir} (they are saved every "
                "save_steps). Run again with --overwrite_output_dir true to start over, or resume a checkpoint by "
                "its path with --resume_from_checkpoint PATH.")
    return (f"at step {step}; the run is saved up to {last}. Resume it: the same command plus "
            "--resume_from_checkpoint true.")


# Exit codes of main(); a test pins each.
EXIT_INPUT, EXIT_HEALTH_STOP, EXIT_JUDGE_STOP, EXIT_INTERRUPTED = 2, 3, 4, 130


def main(argv: list[str] | None = None) -> None:
    """``grpotrl CMD ...``. What it prints and exits with when it does not finish:

    * exit 2, ``grpotrl CMD: error: ...``: bad input (``InputError``), found before the model
      loads wherever it is knowable then (recipe keys and values, rubric files, reward functions,
      datasets, the output dir);
    * exit 3, ``grpotrl CMD: stopped: [health: RULE] ...``: a health rule set to stop (loss or
      gradient NaN/inf, a reward function returning +-inf, a chat header, ...) stopped training
      after saving a resumable checkpoint, which the line names (``HealthStop``);
    * exit 4, ``grpotrl CMD: stopped: judge ...``: a judge gave no score for ``max_failed_batches``
      batches in a row (``grpotrl.rewards.judges.JudgeError``); checkpoints saved before are kept;
    * exit 130, ``grpotrl CMD: interrupted ...``: Ctrl-C (``KeyboardInterrupt``), from the first seconds, while
      torch, transformers and TRL are imported, on; during training the line names the checkpoint
      ``--resume_from_checkpoint true`` continues, or says that none was saved yet;
    * anything else is a bug or a failure outside grpotrl's checks: Python's traceback, exit 1.

    A distributed run exits with these codes, not a collective thread's SIGABRT: the trainer's ``train()``
    registered ``trainers._common.settle_collectives_at_exit``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "report"):
        asked_help = argv[:1] in (["-h"], ["--help"])
        if argv and not asked_help:
            print(f"grpotrl: error: unknown command {argv[0]!r}; the commands are {', '.join((*COMMANDS, 'report'))}.",
                  file=sys.stderr)
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if asked_help else EXIT_INPUT)
    # grpotrl's own INFO lines (what the trainer chose at init and why: padding_free on this device, ...) on
    # stderr, beside TRL's; its warnings as before
    package = logging.getLogger("grpotrl")
    if not any(getattr(h, "grpotrl_cli", False) for h in package.handlers):  # once, however often main() runs
        shown = logging.StreamHandler()
        shown.setFormatter(logging.Formatter("%(message)s"))
        shown.grpotrl_cli = True
        package.addHandler(shown)
    package.setLevel(logging.INFO)
    try:  # around everything that imports torch, transformers or TRL: Ctrl-C in the first seconds too
        _command(argv)
    except KeyboardInterrupt as err:  # Ctrl-C: where the run stands, not a traceback
        print(f"grpotrl {argv[0]}: interrupted" + (f" {err}" if str(err) else "."), file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


def _command(argv: list[str]) -> None:
    """``argv[0]`` run on ``argv[1:]``; bad input, a health stop and a judge's stop each its line and exit code.
    ``report`` imports neither torch nor TRL (``JudgeError``'s module does: imported only for an error)."""
    try:
        if argv[0] == "report":
            from grpotrl.report import main as report

            report(argv[1:])
        else:
            run(argv[0], argv[1:])
    except InputError as err:  # bad input: the message says what to do, a traceback adds nothing
        print(f"grpotrl {argv[0]}: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_INPUT) from None
    except HealthStop as err:  # a health rule stopped training after saving a checkpoint
        print(f"grpotrl {argv[0]}: stopped: {err}", file=sys.stderr)
        raise SystemExit(EXIT_HEALTH_STOP) from None
    except Exception as err:
        from grpotrl.rewards.judges import JudgeError

        if not isinstance(err, JudgeError):
            raise  # a bug or a failure outside grpotrl's checks: its traceback
        # a judge's documented stop (max_failed_batches): the message says what to check
        print(f"grpotrl {argv[0]}: stopped: {err}", file=sys.stderr)
        raise SystemExit(EXIT_JUDGE_STOP) from None


if __name__ == "__main__":
    main()
