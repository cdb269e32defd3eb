"""A PEFT adapter as the model: its ``adapter_config.json`` read once per run start, a Hub id's adapter (offline,
against the session's Hugging Face cache: ``tests/hub_cache.py``), its tokenizer files found as a local
directory's are, and the KL in the reward at beta 0 on a ``peft.PeftModel`` passed in (its reference is the base,
adapter disabled: refused where the adapter was trained before the run). On a tiny Llama over the SmolLM2 tokenizer.
"""

from pathlib import Path

import pytest
import torch
from conftest import HUB_CACHE, arithmetic_prompts, length_reward
from datasets import Dataset
from hub_cache import add_to_cache, mark_missing
from peft import LoraConfig, PeftModel, get_peft_model
from test_lora_sft_then_grpo import LORA
from transformers import AutoModelForCausalLM

import grpotrl
from grpotrl import InputError, cli
from grpotrl.models import sources
from grpotrl.preflight import no_kl_reference

HUB_ADAPTER = "grpotrl-test/tiny-lora"  # a fresh LoRA adapter on the cached grpotrl-test/tiny-llama
ADAPTER_TEMPLATE_MARK = "{#- the adapter's own tokenizer -#}"  # begins the chat template saved beside
# ``hub_adapter_with_tokenizer``'s adapter, not its base's (an added token would need embedding rows the adapter lacks)
RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "smollm2"
GRPO_RECIPE, SFT_RECIPE = str(RECIPES / "grpo_quickstart.yaml"), str(RECIPES / "sft_quickstart.yaml")
CAGRAD_RECIPE = str(RECIPES / "grpo_multitask_cagrad.yaml")  # MultiTaskGRPOTrainer
GAD_RECIPE = str(RECIPES / "gad_quickstart.yaml")
KL_AT_BETA_0 = dict(beta=0.0, use_kl_in_reward=True, kl_in_reward_coef=0.01, max_steps=1)


@pytest.fixture
def adapter_dir(tiny_llama, tmp_path) -> str:
    """A fresh LoRA adapter (``LORA``) on ``tiny_llama``, saved: adapter_config.json and its weights only."""
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(**LORA)).save_pretrained(
        tmp_path / "adapter")
    return str(tmp_path / "adapter")


@pytest.fixture(scope="module")
def hub_adapter(hub_tiny_llama, tmp_path_factory) -> str:
    """``HUB_ADAPTER`` in the session's offline Hub cache: its adapter_config.json names the base by its Hub id."""
    base = AutoModelForCausalLM.from_pretrained(hub_tiny_llama)  # offline, from the cache: PEFT records the id
    saved = tmp_path_factory.mktemp("hub-lora")
    get_peft_model(base, LoraConfig(**LORA)).save_pretrained(saved)
    add_to_cache(HUB_CACHE, HUB_ADAPTER, str(saved))
    assert sources.adapter_config(HUB_ADAPTER)["base_model_name_or_path"] == hub_tiny_llama
    return HUB_ADAPTER


@pytest.fixture(scope="module")
def hub_adapter_with_tokenizer(hub_tiny_llama, tmp_path_factory) -> dict[str, str]:
    """A LoRA adapter on ``hub_tiny_llama`` saved as grpotrl's LoRA SFT saves one (adapter_config.json, its weights,
    its tokenizer files, no config.json), its tokenizer the base's with its chat template marked
    (``ADAPTER_TEMPLATE_MARK``), in the session's offline Hub cache twice: ``"no marker"`` as ``hf download``
    leaves it, ``".no_exist"`` with the marker huggingface_hub writes for config.json after an online 404
    (``hub_cache.mark_missing``). Returns the Hub id of each."""
    from transformers import AutoTokenizer

    saved = tmp_path_factory.mktemp("hub-lora-tok")
    get_peft_model(AutoModelForCausalLM.from_pretrained(hub_tiny_llama), LoraConfig(**LORA)).save_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(hub_tiny_llama)
    tokenizer.chat_template = ADAPTER_TEMPLATE_MARK + tokenizer.chat_template
    tokenizer.save_pretrained(saved)
    assert not (saved / "config.json").exists()
    ids = {"no marker": "grpotrl-test/tiny-lora-tok", ".no_exist": "grpotrl-test/tiny-lora-tok-no-exist"}
    for repo_id in ids.values():
        add_to_cache(HUB_CACHE, repo_id, str(saved))
    mark_missing(HUB_CACHE, ids[".no_exist"], "config.json")
    return ids


def _count_adapter_lookups(monkeypatch) -> list[str]:
    """Every lookup of an ``adapter_config.json`` from here on (``models.sources.model_file``, through which each
    goes: on a Hub id online, one ``cached_file`` request each, a 404 for a plain model), by model name."""
    looked_up, real = [], sources.model_file

    def counted(name_or_path, filename, revision=None):
        if filename == "adapter_config.json":
            looked_up.append(name_or_path)
        return real(name_or_path, filename, revision)

    monkeypatch.setattr(sources, "model_file", counted)
    return looked_up


def _count_peft_reads(monkeypatch) -> list[str]:
    """Every ``adapter_config.json`` PEFT reads itself from here on (``PeftConfig.from_pretrained``, and
    ``PeftModel.from_pretrained`` without a ``config``: each file through ``from_json_file``), by file."""
    from peft.config import PeftConfigMixin

    read, real = [], PeftConfigMixin.from_json_file.__func__

    def counted(cls, path, **kwargs):
        read.append(path)
        return real(cls, path, **kwargs)

    monkeypatch.setattr(PeftConfigMixin, "from_json_file", classmethod(counted))
    return read


def _count_hub_listings(monkeypatch) -> list[str]:
    """Every listing of a Hub repo's files from here on (``models.sources._hub_files``: online one Hub request,
    offline the cached snapshot's), by repo id: how ``adapter_tokenizer_source`` finds a Hub adapter's tokenizer."""
    listed, real = [], sources._hub_files

    def counted(repo_id, revision):
        listed.append(repo_id)
        return real(repo_id, revision)

    monkeypatch.setattr(sources, "_hub_files", counted)
    return listed


def _gad_args(tmp_path, **overrides):
    """One GAD step's settings, small, as ``grpo_args``' (the discriminator from the student's checkpoint)."""
    return grpotrl.GADConfig(output_dir=str(tmp_path / "gad"), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=12, max_steps=1, report_to="none", use_cpu=True, beta=0.0,
                             guard_steps=0, save_strategy="no", disable_tqdm=True, **overrides)


def _sft_rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


# ---------------------------------------------------------------------------------------------
# adapter_config.json: read once per run start
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["grpo on an adapter dir", "grpo on a plain model, LoRA, KL in the reward at beta 0",
                                   "sft on an adapter dir", "gad on an adapter dir", "gad on a plain model"])
def test_adapter_config_is_looked_up_once_per_run_start(start, adapter_dir, tiny_llama, grpo_args, tmp_path,
                                                         monkeypatch):
    """The preflight reads it once (``preflight.prepare_model_and_tokenizer``; GAD: ``check_gad``, whose lookup
    GRPO's checks take, ``preflight.ADAPTER_LOOKUP``) and hands it on: to the KL-reference, generation-config and
    resume checks, to the trainer's load (``trainers.adapter.adapter_loaded``) and to GAD's discriminator (its
    merge-ability check and its merge); PEFT reads the file not at all (``PeftAdapter.peft_config`` is the config
    it would read). A step that asks again fails the count (each check asking for itself: 5 for GRPO on an adapter
    dir, 3 for the LoRA run, 4 for SFT; GAD 2, and PEFT's own reads 4)."""
    looked_up, read_by_peft = _count_adapter_lookups(monkeypatch), _count_peft_reads(monkeypatch)
    if start.startswith("gad"):
        from test_gad import toy_rows

        model = adapter_dir if "adapter" in start else tiny_llama
        grpotrl.GADTrainer(model=model, args=_gad_args(tmp_path), train_dataset=Dataset.from_list(toy_rows(8)))
    elif start.startswith("sft"):
        grpotrl.SFTTrainer(model=adapter_dir, train_dataset=Dataset.from_list(_sft_rows()),
                           args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, report_to="none",
                                                  use_cpu=True, guard_steps=-1))
        model = adapter_dir
    elif "plain" in start:
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(**KL_AT_BETA_0),
                            train_dataset=arithmetic_prompts(8), peft_config=LoraConfig(**LORA))
        model = tiny_llama
    else:
        grpotrl.GRPOTrainer(model=adapter_dir, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                            train_dataset=arithmetic_prompts(8))
        model = adapter_dir
    assert looked_up == [model]
    assert read_by_peft == []


@pytest.mark.parametrize("command, start", [("grpo", "an adapter dir"), ("grpo", "a plain model, LoRA"),
                                            ("grpo", "an adapter dir, CAGrad"), ("sft", "an adapter dir"),
                                            ("gad", "an adapter dir"), ("gad", "an adapter dir, D its own")])
def test_a_cli_run_start_looks_adapter_config_up_once(command, start, adapter_dir, tiny_llama, tmp_path,
                                                     monkeypatch):
    """``grpotrl grpo|sft --config RECIPE``: the CLI's recipe check (``preflight.model.check_model_args``: the
    recipe's LoRA settings against the adapter's) looks the model up, and the trainer's preflight takes that lookup
    (``preflight.ADAPTER_LOOKUP``) rather than asking again; GRPOTrainer, MultiTaskGRPOTrainer (CAGrad),
    SFTTrainer and GADTrainer alike (GAD's D, from the student's checkpoint, takes it as GRPO's checks do). A trainer
    that asks again makes 2."""
    model = tiny_llama if "plain" in start else adapter_dir
    recipe = {"sft": SFT_RECIPE, "gad": GAD_RECIPE}.get(command, CAGRAD_RECIPE if "CAGrad" in start else GRPO_RECIPE)
    argv = [command, "--config", recipe, "--model_name_or_path", model, "--use_peft", "true", "--max_steps", "1",
            "--output_dir", str(tmp_path / "out")]
    if command != "sft":
        argv += ["--guard_steps", "-1", "--per_device_train_batch_size", "8", "--max_completion_length", "8"]
    if "D its own" in start:
        argv += ["--discriminator_model_name_or_path", tiny_llama]
    if "plain" in start:
        argv += ["--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    looked_up = _count_adapter_lookups(monkeypatch)
    cli.main(argv)
    assert looked_up == [model], f"{len(looked_up)} lookups"


def test_an_adapters_peft_config_is_the_one_peft_reads_from_its_file(adapter_dir):
    """``PeftAdapter.peft_config``, built from the config read once, equals ``PeftConfig.from_pretrained``'s of
    the same file (what PEFT's own loads would build), and is a new object each time (the discriminator's merge
    changes its copy)."""
    from peft import PeftConfig

    adapter = sources.find_adapter(adapter_dir)
    built = adapter.peft_config()
    assert type(built) is type(PeftConfig.from_pretrained(adapter_dir))
    assert built.to_dict() == PeftConfig.from_pretrained(adapter_dir).to_dict()
    assert adapter.peft_config() is not built


@pytest.mark.parametrize("tokenizer", ["loaded from the adapter", "given"])
def test_a_hub_adapters_tokenizer_source_is_worked_out_once_and_only_where_the_tokenizer_loads(
        tokenizer, hub_adapter, hub_tiny_llama, grpo_args, monkeypatch):
    """Where the tokenizer loads from the model (no ``processing_class``), the preflight works out its source
    (``adapter_tokenizer_source``: one listing of the Hub repo's files, online a Hub request) once, and the
    trainer's load uses the tokenizer it loaded. With ``processing_class`` given, nothing is listed (a
    source the run does not use is not worked out)."""
    from transformers import AutoTokenizer

    given = AutoTokenizer.from_pretrained(hub_tiny_llama, padding_side="left") if tokenizer == "given" else None
    listed = _count_hub_listings(monkeypatch)
    grpotrl.GRPOTrainer(model=hub_adapter, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                        args=grpo_args(max_steps=1), processing_class=given)
    assert listed == ([] if given is not None else [hub_adapter])


def test_a_changed_directory_is_read_again_by_the_next_run(tiny_llama, adapter_dir, grpo_args, monkeypatch):
    """Nothing is kept from one run start to the next (no memo keyed on the path): a run on the directory, then
    the same directory holding a plain model, which the second run trains as one."""
    first = grpotrl.GRPOTrainer(model=adapter_dir, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                train_dataset=arithmetic_prompts(8))
    assert isinstance(first.model, PeftModel)
    import shutil

    shutil.rmtree(adapter_dir)
    shutil.copytree(tiny_llama, adapter_dir)
    second = grpotrl.GRPOTrainer(model=adapter_dir, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                 train_dataset=arithmetic_prompts(8))
    assert not isinstance(second.model, PeftModel)


# ---------------------------------------------------------------------------------------------
# A Hub id's adapter, offline
# ---------------------------------------------------------------------------------------------

def test_grpo_on_a_hub_adapter_trains_that_adapter_on_its_frozen_hub_base(hub_adapter, hub_tiny_llama, grpo_args,
                                                                          monkeypatch):
    """``model="org/adapter"``, with HF_HUB_OFFLINE=1 (the session's): the base loads by the Hub id its
    adapter_config.json names, the adapter onto it; one step moves the adapter's weights and no base weight.
    adapter_config.json is looked up once."""
    looked_up = _count_adapter_lookups(monkeypatch)
    trainer = grpotrl.GRPOTrainer(model=hub_adapter, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                  args=grpo_args(max_steps=1, learning_rate=1e-2))
    assert looked_up == [hub_adapter]
    model = trainer.model
    assert isinstance(model, PeftModel) and model.peft_config["default"].base_model_name_or_path == hub_tiny_llama
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable), sorted(trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    after = dict(model.named_parameters())
    assert any(not torch.equal(after[n], before[n]) for n in trainable), "the adapter did not move"
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trainable), "a base weight moved"


def test_a_hub_adapters_own_tokenizer_is_found_by_any_sentencepiece_or_tiktoken_file(hub_tiny_llama, tmp_path,
                                                                                      grpo_args, monkeypatch):
    """A Hub adapter whose tokenizer vocabulary is a ``*.model`` file of another name than ``TOKENIZER_FILES``'
    (as a local directory's is recognised) is the tokenizer's source, not its base: offline, its cached snapshot
    (``models.sources.adapter_tokenizer_path``)."""
    from transformers import AutoProcessor

    from grpotrl.preflight import prepare_model_and_tokenizer

    get_peft_model(AutoModelForCausalLM.from_pretrained(hub_tiny_llama), LoraConfig(**LORA)).save_pretrained(tmp_path)
    snapshot = add_to_cache(HUB_CACHE, "grpotrl-test/tiny-lora-spm", str(tmp_path), extra={"custom_spm.model": "spm"})
    sources_asked = []

    def asked(source, *args, **kwargs):  # records where the tokenizer would load from; loads nothing
        sources_asked.append(source)
        raise RuntimeError("tokenizer source recorded")

    monkeypatch.setattr(AutoProcessor, "from_pretrained", asked)
    with pytest.raises(RuntimeError, match="tokenizer source recorded"):
        prepare_model_and_tokenizer("grpotrl-test/tiny-lora-spm", None, grpo_args(), None, "grpo")
    assert sources_asked == [snapshot]


@pytest.mark.parametrize("trainer, cache", [("grpo", "no marker"), ("grpo", ".no_exist"), ("sft", "no marker")])
def test_a_hub_adapter_holding_its_own_tokenizer_starts_on_that_tokenizer(trainer, cache, hub_adapter_with_tokenizer,
                                                                          hub_tiny_llama, grpo_args, tmp_path):
    """``model="org/adapter"`` offline, no ``processing_class``: the adapter's own tokenizer loads (it holds
    ``ADAPTER_TEMPLATE_MARK``, its base's does not), from its cached snapshot
    (``models.sources.adapter_tokenizer_path``) as from a local adapter dir. Handed the Hub id, transformers'
    AutoProcessor looks up the adapter's config.json and, without huggingface_hub's ``.no_exist`` marker for it,
    raises an OSError ("We couldn't connect to ...") instead of passing over it; with the marker (the control, which
    loaded by the Hub id too) it passes over it. GRPOTrainer and SFTTrainer alike."""
    from transformers import AutoTokenizer

    model = hub_adapter_with_tokenizer[cache]
    if trainer == "grpo":
        started = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                      args=grpo_args(max_steps=1))
    else:
        started = grpotrl.SFTTrainer(model=model, train_dataset=Dataset.from_list(_sft_rows()),
                                     args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1,
                                                            report_to="none", use_cpu=True, guard_steps=-1))
    assert isinstance(started.model, PeftModel)
    assert started.processing_class.chat_template.startswith(ADAPTER_TEMPLATE_MARK)
    assert not AutoTokenizer.from_pretrained(hub_tiny_llama).chat_template.startswith(ADAPTER_TEMPLATE_MARK)


def test_a_hub_adapters_own_tokenizer_that_cannot_load_says_what_to_do(hub_adapter_with_tokenizer, grpo_args,
                                                                       monkeypatch):
    """Where transformers cannot load the adapter's own tokenizer (an OSError: online, a request for one of its
    files, config.json included, refused or unanswered), the error names the adapter and the error, and says how
    to load it from files on disk instead (download it, pass its directory, or pass ``processing_class``)."""
    from transformers import AutoProcessor

    from grpotrl.preflight import prepare_model_and_tokenizer

    def unreachable(source, *args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(AutoProcessor, "from_pretrained", unreachable)
    model = hub_adapter_with_tokenizer["no marker"]
    with pytest.raises(InputError, match=rf"The tokenizer of the PEFT adapter '{model}' .*could not be loaded: "
                                         r"OSError: We couldn't connect .*`hf download " + model + r"`.*pass its "
                                         r"local directory as the model.*processing_class="):
        prepare_model_and_tokenizer(model, None, grpo_args(), None, "grpo")


# ---------------------------------------------------------------------------------------------
# KL in the reward at beta 0 on a peft.PeftModel passed in
# ---------------------------------------------------------------------------------------------

def _peft_model(tiny_llama) -> PeftModel:
    return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(**LORA))


def test_a_kl_in_the_reward_at_beta_0_on_a_trained_peft_model_is_refused(tiny_llama, grpo_args):
    """Its reference would be the base (TRL copies no ``ref`` adapter at beta 0), not the policy it starts as."""
    model = _peft_model(tiny_llama)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B.default." in n)[0, 0] = 0.5  # trained before
    with pytest.raises(InputError, match=r"use_kl_in_reward with beta=0.0 on the peft.PeftModel passed as model, "
                                         r"whose adapter has LoRA B weights that are not 0 \(1, e.g. .*lora_B.*\).* "
                                         r"the reference would be the base model .* Set beta: 0.01 \(with "
                                         r"use_kl_loss: false.*peft_config=peft.LoraConfig"):
        grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=grpo_args(**KL_AT_BETA_0),
                            train_dataset=arithmetic_prompts(8))


def test_a_kl_in_the_reward_at_beta_0_on_a_peft_model_whose_b_cannot_be_read_is_refused(tiny_llama, grpo_args):
    """A B weight partitioned as DeepSpeed ZeRO-3 holds it (0 elements here, the real count in ``ds_numel``)
    cannot show that the adapter is fresh: refused, saying so, never taken as 0."""
    model = _peft_model(tiny_llama)
    partitioned = next(p for n, p in model.named_parameters() if ".lora_B.default." in n)
    partitioned.ds_numel = partitioned.numel()
    partitioned.data = torch.empty(0)
    with pytest.raises(InputError, match=r"whose adapter has LoRA B weights that cannot be read here \(1, .*"
                                         r"partitioned by DeepSpeed ZeRO-3.* Set beta: 0.01"):
        grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=grpo_args(**KL_AT_BETA_0),
                            train_dataset=arithmetic_prompts(8))


def test_a_kl_in_the_reward_at_beta_0_on_a_peft_model_with_a_trained_modules_to_save_copy_is_refused(
        tiny_llama, grpo_args):
    """A ``modules_to_save`` copy (here the LM head) replaces the base's module with the adapter on: trained, the
    disabled adapter is not the policy though every B is 0. A fresh copy (equal to the base's) is taken."""
    def model_with_head(trained: bool):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                               LoraConfig(**LORA, modules_to_save=["lm_head"]))
        if trained:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if ".modules_to_save.default." in n).add_(0.01)
        return model

    with pytest.raises(InputError, match=r"whose adapter 'default' has a modules_to_save copy of .*lm_head that "
                                         r"differs from the base's .* Set beta: 0.01"):
        grpotrl.GRPOTrainer(model=model_with_head(True), reward_funcs=length_reward, args=grpo_args(**KL_AT_BETA_0),
                            train_dataset=arithmetic_prompts(8))
    trainer = grpotrl.GRPOTrainer(model=model_with_head(False), reward_funcs=length_reward,
                                  args=grpo_args(**KL_AT_BETA_0), train_dataset=arithmetic_prompts(8))
    assert trainer.ref_model is None


def test_I10_a_kl_in_the_reward_at_beta_0_on_a_fresh_peft_model_is_kept(tiny_llama, grpo_args):
    """Control: B at 0 (PEFT's start), the disabled adapter is the policy bit for bit: the KL column is 0."""
    trainer = grpotrl.GRPOTrainer(model=_peft_model(tiny_llama), reward_funcs=length_reward,
                                  args=grpo_args(**KL_AT_BETA_0), train_dataset=arithmetic_prompts(8))
    assert trainer.ref_model is None
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    assert trainer.kl_reward([prompt], ["3"], completion_ids=[[28, 2]]) == [0.0]


def test_the_kl_reference_error_at_beta_above_0_says_the_reference_was_removed(tiny_llama, grpo_args):
    """``kl_in_reward_coef`` is grpotrl's own ``GRPOConfig`` field (TRL 1.16's has none), None by default: the
    reward's coefficient is then ``beta``. At beta 0 the config refuses None (a coefficient of 0), so
    ``no_kl_reference`` meets None where beta > 0 and the reference is gone after ``__init__`` (the run-time guard,
    ``trainers.reference_kl``): TRL built a reference there, so the error says it was removed (here: the adapter
    merged away), not to set beta, which is set."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                  args=grpo_args(beta=0.04, use_kl_in_reward=True, max_steps=1),
                                  peft_config=LoraConfig(**LORA))
    assert trainer.args.kl_in_reward_coef is None
    trainer.model = trainer.model.merge_and_unload()
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    with pytest.raises(InputError) as missing:
        trainer.kl_reward([prompt], ["3"], completion_ids=[[28, 2]])
    assert str(missing.value) == no_kl_reference(0.04, None)
    assert "removed afterwards" in str(missing.value) and "set beta" not in str(missing.value)  # beta is 0.04

