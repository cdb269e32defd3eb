"""``grpotrl sft|grpo|gad --config recipe.yaml [--key value ...]``: straight-line glue, no logic.

    grpotrl sft  --config recipes/smollm2/sft_quickstart.yaml
    grpotrl grpo --config recipes/smollm2/grpo_quickstart.yaml --max_steps 5
    grpotrl gad  --config recipes/smollm2/gad_quickstart.yaml
    grpotrl report outputs/smollm2-grpo-quickstart   # PNG plots from trainer_state.json
    python -m grpotrl.cli grpo --config recipes/smollm2/grpo_quickstart.yaml
    accelerate launch --config_file recipes/accelerate/single.yaml -m grpotrl.cli grpo --config ...

A recipe is a flat YAML mapping of fields of three dataclasses: ``ScriptArguments`` /
``GRPOScriptArguments`` below (dataset, reward names), ``trl.ModelConfig`` (model, PEFT) and
``grpotrl.SFTConfig`` / ``GRPOConfig`` / ``GADConfig`` (everything ``TrainingArguments`` and TRL know).
``--key value`` on the command line overrides the recipe. A key that no dataclass knows is an
error, with the closest known names.

Order: parse -> model path (alias, local dir) and quantization/LoRA settings -> tokenizer (chat
template, stop tokens) -> dataset (+ reward columns) -> resume checkpoint (every file present and
whole); only then is the model loaded, so bad input costs seconds, not a model load. Simplified
on purpose: datasets are shipped (``quickstart``, ``multitask``) or local JSON files (grpotrl
never downloads), rewards come from ``grpotrl.rewards.rules`` by name (``task:name`` per task,
which trains with ``MultiTaskGRPOTrainer``, as does ``cagrad``).
"""

from __future__ import annotations

import grpotrl  # noqa: I001  first: sets OMP_WAIT_POLICY before torch is imported

import difflib
import os
import sys
from dataclasses import dataclass, field

from grpotrl import templates, validation
from grpotrl.errors import HealthStop, InputError

COMMANDS = ("sft", "grpo", "gad")
USAGE = "usage: grpotrl {sft,grpo,gad} --config RECIPE.yaml [--key value ...]\n       grpotrl report OUTPUT_DIR [--out DIR]"


@dataclass
class ScriptArguments:
    dataset_name: str = field(
        default="quickstart",
        metadata={"help": "`quickstart` or `multitask` (shipped with grpotrl), a local .json/.jsonl file (its "
                  "rows are the train split) or a local directory of them named by split (train.jsonl, test.jsonl)."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split to evaluate on when eval_strategy != 'no'."}
    )


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(
        default_factory=lambda: ["exact_answer", "format"],
        metadata={"help": f"Reward functions by name, from grpotrl.rewards.rules: {list(validation.REWARD_FUNCS)}; "
                  "as task:name (every entry) for rewards per task, e.g. hallucination:exact_answer "
                  "fairness:even_handed (MultiTaskGRPOTrainer, rows labelled in task_column)."},
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
    ``yaml.safe_load`` by ``TrlParser``) and ``--key value`` overrides."""
    if command not in COMMANDS:
        raise InputError(f"Unknown command {command!r}; use one of {list(COMMANDS)}. {USAGE}")
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv) or not os.path.isfile(argv[i + 1]):
            given = argv[i + 1] if i + 1 < len(argv) else "nothing"
            raise InputError(f"--config needs a recipe YAML file, got {given}. See recipes/smollm2/ for examples.")
    parser = make_parser(command)
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
    return tuple(dataclasses)


def _with_hints(keys: list[str], known: set[str]) -> str:
    """``'lerning_rate' (did you mean 'learning_rate'?)`` for each key that has a close known one."""
    out = []
    for key in keys:
        name = key.lstrip("-").split("=")[0]
        close = difflib.get_close_matches(name, sorted(known), n=3)
        out.append(f"{name!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(key))
    return ", ".join(out)


def load_split(dataset_name: str, split: str):
    """A split of a shipped dataset or of a local JSON file / directory; never a download."""
    from datasets import load_dataset

    from grpotrl.data import SHIPPED, load_shipped

    if dataset_name in SHIPPED:
        return load_shipped(dataset_name, split)
    if os.path.isfile(dataset_name):
        if split != "train":
            raise InputError(f"dataset_name {dataset_name!r} is one file, which is the 'train' split only; "
                             f"split {split!r} needs a directory with {split}.jsonl, or set eval_strategy: 'no'.")
        return load_dataset("json", data_files=dataset_name, split="train")
    if os.path.isdir(dataset_name):
        splits = load_dataset(dataset_name)
        if split not in splits:
            raise InputError(f"Dataset dir {dataset_name!r} has splits {list(splits)}, not {split!r}. Set "
                             "dataset_train_split / dataset_test_split to one of those.")
        return splits[split]
    raise InputError(
        f"dataset_name {dataset_name!r} is neither a shipped dataset {list(SHIPPED)} nor a local file or directory. "
        "grpotrl never downloads datasets (no network here): save the data as JSONL locally and point "
        "dataset_name at it."
    )


def run(command: str, argv: list[str]) -> None:
    script_args, training_args, model_args = parse_args(command, argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from grpotrl.hub import check_model_source
    from grpotrl.hub import generation_config as hub_generation_config
    from grpotrl.models import resolve_model_path
    from grpotrl.trainers._common import check_model_args, resume_checkpoint

    ################
    # Model path and tokenizer: checked before any weights are read
    ################
    model_path = resolve_model_path(model_args.model_name_or_path)  # an alias, a local dir or a Hub id
    revision = model_args.model_revision
    check_model_source(model_path, revision)  # Hub ids: config and tokenizer files only, no weights yet
    check_model_args(model_args, model_path)  # quantization needs LoRA; LoRA targets exist
    tokenizer = AutoTokenizer.from_pretrained(
        model_path, revision=revision, trust_remote_code=training_args.trust_remote_code
    )
    templates.require_chat_template(tokenizer)
    stop_ids = templates.stop_token_ids(tokenizer, hub_generation_config(model_path, revision))
    if command in ("grpo", "gad") and training_args.check_template:
        templates.check_fingerprint(model_path, tokenizer, revision=revision)  # I2: before the weights are read

    ################
    # Dataset and rewards
    ################
    train_dataset = load_split(script_args.dataset_name, script_args.dataset_train_split)
    kind = "sft" if command == "sft" else "grpo"
    validation.check_dataset(train_dataset, script_args.dataset_train_split, kind=kind)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_split(script_args.dataset_name, script_args.dataset_test_split)
        validation.check_dataset(eval_dataset, script_args.dataset_test_split, kind=kind)
    if command == "gad":  # rows need the teacher's response
        from grpotrl.trainers.gad import check_teacher_responses

        check_teacher_responses(train_dataset, script_args.dataset_train_split)
        check_teacher_responses(eval_dataset, script_args.dataset_test_split)
    if command == "grpo":
        reward_funcs = validation.resolve_reward_funcs(script_args.reward_funcs)
        validation.check_reward_columns(reward_funcs, train_dataset, script_args.dataset_train_split)

    ################
    # Resume checkpoint
    ################
    checkpoint = resume_checkpoint(training_args.resume_from_checkpoint, training_args, command, model_args.use_peft)
    if checkpoint and training_args.check_template:
        templates.check_fingerprint(checkpoint, tokenizer)  # I2: the checkpoint's template is this run's

    ################
    # Model and trainer
    ################
    transformers.set_seed(training_args.seed)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype),
        quantization_config=get_quantization_config(model_args),
    )
    trainer_cls = {"sft": grpotrl.SFTTrainer, "grpo": grpotrl.GRPOTrainer, "gad": grpotrl.GADTrainer}[command]
    if command == "grpo" and (isinstance(reward_funcs, dict) or training_args.cagrad != "off"):
        trainer_cls = grpotrl.MultiTaskGRPOTrainer  # rewards per task, CAGrad
    # GAD's reward is its discriminator, loaded by the trainer; SFT has none
    rewards = {"reward_funcs": reward_funcs} if command == "grpo" else {}
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        **rewards,
    )

    ################
    # Train, save, summarize
    ################
    result = trainer.train(resume_from_checkpoint=checkpoint or None)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the whole log history, beside the weights
    trainer.accelerator.print(summary(command, trainer.state.log_history))
    trainer.accelerator.print(
        f"grpotrl {command}: {trainer.state.global_step} steps in {result.metrics['train_runtime']:.0f} s, "
        f"stop ids {stop_ids}; model, tokenizer, template fingerprint and trainer_state.json in "
        f"{training_args.output_dir}"
    )
    trainer.end()


def summary(command: str, log_history: list[dict], window: int = 5) -> str:
    """Mean of the first and last ``window`` logged values of the metrics that tell progress.

    >>> summary("sft", [{"loss": 2.0}, {"loss": 1.0}, {"loss": 0.5}], window=1)
    'loss: 2.000 (first 1 steps) -> 0.500 (last 1 steps)'
    """
    keys = {"sft": ["loss"], "gad": ["gad/d_acc", "gad/student_score", "gad/teacher_score", "completions/mean_length"]
            }.get(command, ["reward", "rewards/exact_answer_reward/mean", "completions/mean_length"])
    lines = []
    for key in keys:
        values = [entry[key] for entry in log_history if key in entry]
        if values:
            first, last = values[:window], values[-window:]
            lines.append(f"{key}: {sum(first) / len(first):.3f} (first {len(first)} steps) -> "
                         f"{sum(last) / len(last):.3f} (last {len(last)} steps)")
    return "\n".join(lines) or "nothing logged"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "report"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    try:
        if argv[0] == "report":
            from grpotrl.report import main as report

            report(argv[1:])
        else:
            run(argv[0], argv[1:])
    except InputError as err:  # bad input: the message says what to do, a traceback adds nothing
        print(f"grpotrl {argv[0]}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except HealthStop as err:  # a health rule stopped training after saving a checkpoint
        print(f"grpotrl {argv[0]}: stopped: {err}", file=sys.stderr)
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
