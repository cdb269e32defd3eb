"""QLoRA: SmolLM2 loaded in 4-bit / 8-bit through bitsandbytes, LoRA adapters trained by
grpotrl's GRPOTrainer with every guard on, and the recipe mistakes that must stop before a
model is loaded (``grpotrl.trainers._common``)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

import grpotrl
from grpotrl import cli
from grpotrl.errors import InputError
from grpotrl.models.quantization import pin_quantized_kernels

from conftest import arithmetic_prompts, length_reward

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

QLORA_RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2" / "grpo_qlora.yaml")


def load_quantized(path, bits: int):
    if bits == 4:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32)


def prompt_logprobs(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits  # [1, L, V]
    return torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]  # [L-1]


# ---------------------------------------------------------------------------------------------
# Recipe mistakes: an InputError before any weights are read
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was validated")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)  # what TRL's create_model_from_path reaches


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_full_finetuning_is_refused_before_the_model_loads(tmp_path, smollm2_path, no_model_load, bits):
    with pytest.raises(InputError, match=rf"load_in_{bits}bit: true without use_peft: true .* Add `use_peft: true`"):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--use_peft", "false", "--output_dir", str(tmp_path),
                         "--load_in_4bit", str(bits == 4), "--load_in_8bit", str(bits == 8)])


def test_4bit_and_8bit_together_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="8 bit and 4 bit"):
        cli.parse_args("grpo", ["--config", QLORA_RECIPE, "--load_in_8bit", "true", "--output_dir", str(tmp_path)])


def test_4bit_needs_a_compute_dtype(tmp_path, smollm2_path, no_model_load):
    with pytest.raises(InputError, match=r"load_in_4bit computes in `dtype`, which is 'auto'.*float32"):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--dtype", "auto", "--output_dir", str(tmp_path)])


def test_misspelled_lora_target_module_is_named_with_a_hint(tmp_path, smollm2_path, no_model_load):
    # PEFT would adapt q_proj alone and ignore the typo without a word
    with pytest.raises(InputError, match=r"'gate_prj' \(did you mean 'gate_proj'\?\).*'q_proj'"):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--lora_target_modules", "q_proj", "gate_prj",
                         "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("pattern, match", [
    (r".*\.(q_prj|v_proj)x", r"regular expression that must match a module's whole dotted name .* matches no module"),
    (r"(q_proj", r"read by PEFT as a regular expression, and it is not one"),
])
def test_a_lora_target_regex_that_matches_no_module_is_refused_before_the_load(tmp_path, smollm2_path, no_model_load,
                                                                              pattern, match):
    """PEFT full-matches a string lora_target_modules against every module's dotted name, and fails after the load
    when none matches; grpotrl matches it on the meta-device skeleton first. A pattern that matches gets past the
    check, to the load."""
    with pytest.raises(InputError, match=match):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--lora_target_modules", pattern, "--output_dir", str(tmp_path)])
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--lora_target_modules", r".*\.(q_proj|v_proj)",
                         "--output_dir", str(tmp_path / "ok")])


def test_trainer_refuses_a_quantized_model_without_peft_config(tiny_llama, smollm2_tokenizer, grpo_args):
    from grpotrl.preflight import prepare_model_and_tokenizer

    model = load_quantized(tiny_llama, 4)
    with pytest.raises(InputError, match="4-bit.*no peft_config.*LoraConfig"):
        prepare_model_and_tokenizer(model, smollm2_tokenizer, grpo_args(), arithmetic_prompts(4), "grpo",
                                    peft_config=None)


@pytest.mark.parametrize("given", ["object", "dict"])
@pytest.mark.parametrize("bits", [4, 8])
def test_python_api_refuses_a_quantized_path_without_peft_config_before_the_load(tiny_llama, grpo_args, monkeypatch,
                                                                                bits, given):
    """From Python, a model path with ``model_init_kwargs={"quantization_config": ...}`` and no
    peft_config: refused in __init__ before any weights load (transformers' Trainer would refuse
    it only after loading); with a LoraConfig the same settings get past the check (to the load)."""
    from peft import LoraConfig
    from transformers import PreTrainedModel

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", reached)
    config = BitsAndBytesConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    init = {"quantization_config": config if given == "object" else config.to_dict(), "dtype": torch.float32}
    args = grpo_args(model_init_kwargs=init)
    with pytest.raises(InputError, match=rf"quantization_config'\] asks for {bits}-bit .* no peft_config .*LoraConfig"):
        grpotrl.GRPOTrainer(tiny_llama, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts(4))
    with pytest.raises(Reached):
        grpotrl.GRPOTrainer(tiny_llama, reward_funcs=length_reward, args=grpo_args(model_init_kwargs=init),
                            train_dataset=arithmetic_prompts(4), peft_config=LoraConfig(r=4, target_modules=["q_proj"]))


# ---------------------------------------------------------------------------------------------
# One kernel per layer: what sampled is what the loss and the I5 guard score
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_I5_quantized_layers_compute_the_same_function_in_train_and_eval(smollm2_path, smollm2_tokenizer, bits):
    """bitsandbytes picks CPU kernels by mode: unpinned, an eval forward of a 4-bit layer repacks it
    for a bf16 kernel without autograd (0.34 nats off, and no LoRA weight gets a gradient after);
    an 8-bit layer runs int8 matmuls in eval, 1.2 nats off the training kernel."""
    from peft import LoraConfig, get_peft_model

    model = load_quantized(smollm2_path, bits)
    assert model.get_memory_footprint() < (180 if bits == 4 else 260) * 2**20  # fp32: 540 MB
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert pin_quantized_kernels(model) == 30 * 7  # every quantized linear layer (lm_head stays fp32)
    ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
    model.train()
    train = prompt_logprobs(model, ids)
    model.eval()
    with torch.no_grad():
        evaluated = prompt_logprobs(model, ids)
    model.train()
    assert (train.detach() - evaluated).abs().max() < 1e-5
    prompt_logprobs(model, ids).sum().backward()  # after the eval forward: gradients still flow
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


# ---------------------------------------------------------------------------------------------
# QLoRA GRPO steps on SmolLM2 in 4-bit
# ---------------------------------------------------------------------------------------------

def test_qlora_grpo_steps_on_smollm2_4bit_train_lora_only_with_guards_on(smollm2_path, smollm2_tokenizer,
                                                                         grpo_args):
    from peft import LoraConfig

    model = load_quantized(smollm2_path, 4)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}  # 4-bit codes [N*K/2, 1] uint8, fp32 rest
    trainer = grpotrl.GRPOTrainer(
        model=model, reward_funcs=[length_reward], processing_class=smollm2_tokenizer,
        args=grpo_args(max_steps=2, per_device_train_batch_size=4, max_completion_length=6, learning_rate=1e-3,
                       logging_steps=1, guard_steps=-1),
        train_dataset=arithmetic_prompts(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora_before and all("lora_" in n for n in lora_before)
    assert trainer.padding_free  # grpotrl's default: the loss's logprobs from packed rows, I5 checks them
    trainer.train()

    gaps = [e["guards/logprob_max_gap"] for e in trainer.state.log_history if "guards/logprob_max_gap" in e]
    assert len(gaps) == 2 and max(gaps) < trainer.args.guard_logprob_atol  # I1-I5 ran on both steps, I5 held
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(lora_before[n], after[n]) for n in lora_before)  # the adapters moved
    frozen = dict(trainer.model.get_base_model().named_parameters())
    assert all(torch.equal(p, frozen[_base_name(n, frozen)]) for n, p in base.items())  # the base stayed put


def _base_name(name: str, names) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> its name once PEFT wrapped the layer."""
    if name in names:
        return name
    module, leaf = name.rsplit(".", 1)
    return f"{module}.base_layer.{leaf}"


@pytest.mark.slow
def test_qlora_resume_matches_an_uninterrupted_run(smollm2_path, smollm2_tokenizer, grpo_args, tmp_path):
    from peft import LoraConfig

    def trainer(out):
        return grpotrl.GRPOTrainer(
            model=load_quantized(smollm2_path, 4), reward_funcs=[length_reward], processing_class=smollm2_tokenizer,
            args=grpo_args(output_dir=str(out), max_steps=3, save_strategy="steps", save_steps=2, guard_steps=0,
                           per_device_train_batch_size=4, max_completion_length=6, learning_rate=1e-3),
            train_dataset=arithmetic_prompts(8),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        )

    straight = trainer(tmp_path / "straight")
    straight.train()
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    want = {n: p for n, p in straight.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys()
    assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)


def test_lora_settings_without_use_peft_are_refused_before_the_model_loads(tmp_path, smollm2_path, no_model_load):
    """TRL builds no adapter without use_peft and ignores lora_* without a word: the run would train every weight."""
    with pytest.raises(InputError, match=r"lora_dropout: 0.0, lora_target_modules: 'q_proj' without use_peft: true.*Add `use_peft: "
                                         r"true`.*drop the lora_\* settings"):
        cli.run("grpo", ["--config", QLORA_RECIPE, "--use_peft", "false", "--load_in_4bit", "false",
                         "--lora_target_modules", "q_proj", "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("quantized, loaded", [("--load_in_8bit", "in 8-bit"), (None, "unquantized")])
def test_4bit_settings_without_load_in_4bit_are_refused_before_the_model_loads(tmp_path, smollm2_path, no_model_load,
                                                                               quantized, loaded):
    """TRL's quantization config reads bnb_4bit_quant_type, use_bnb_nested_quant and bnb_4bit_quant_storage for
    load_in_4bit only: under load_in_8bit, or unquantized, they were ignored without a word."""
    flags = ["--load_in_4bit", "false", "--bnb_4bit_quant_type", "fp4", "--use_bnb_nested_quant", "true"]
    with pytest.raises(InputError, match=rf"bnb_4bit_quant_type: 'fp4', use_bnb_nested_quant: True without "
                                         rf"load_in_4bit: true.*ignored and the model loaded {loaded}\. Add "
                                         r"`load_in_4bit: true`"):
        cli.run("grpo", ["--config", QLORA_RECIPE, *flags, *([quantized, "true"] if quantized else []),
                         "--output_dir", str(tmp_path)])


def test_the_trainers_quantization_config_without_peft_is_refused_before_the_model_loads(tiny_llama, grpo_args,
                                                                                      no_model_load):
    """TRL's own trainer argument ``quantization_config`` (beside ``model_init_kwargs``' one, which was checked):
    4-bit weights without a peft_config cannot take an update; transformers said so only after the load."""
    with pytest.raises(InputError, match=r"The trainer's quantization_config asks for 4-bit \(bitsandbytes\) weights "
                                         r"and no peft_config was given"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(), quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_a_misspelled_peft_config_target_is_named_before_the_model_loads(tiny_llama, grpo_args, no_model_load):
    """From Python, ``peft_config=LoraConfig(target_modules=[...])`` with a typo trained the other names only (the
    CLI's lora_target_modules was checked; this was not)."""
    from peft import LoraConfig

    with pytest.raises(InputError, match=r"peft_config.target_modules names no module of llama .*'gate_prj' \(did you "
                                         r"mean 'gate_proj'\?\)"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(),
                            peft_config=LoraConfig(r=4, target_modules=["q_proj", "gate_prj"]))


@pytest.mark.parametrize("init, match", [({"torch_dtype": "bfloat16"}, r"model_init_kwargs sets torch_dtype='bfloat16'"
                                                                       r".*Write it as dtype"),
                                         ({"dtype": "bf16"}, r"dtype='bf16' is not one TRL reads.*\(write 'bfloat16'\)")])
def test_model_init_dtype_that_trl_would_ignore_or_reject_is_refused_before_the_load(tiny_llama, grpo_args,
                                                                                     no_model_load, init, match):
    """``torch_dtype`` loaded float32 weights silently (TRL passes ``dtype``, float32 unless set, and transformers
    then ignores ``torch_dtype``); ``dtype: bf16`` failed in TRL's loader with a ValueError."""
    with pytest.raises(InputError, match=match):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(model_init_kwargs=init),
                            train_dataset=arithmetic_prompts())
