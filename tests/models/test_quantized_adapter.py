"""A PEFT adapter directory (a LoRA SFT's output) trained on its base loaded in 4-bit through bitsandbytes
(``trainers.adapter.adapter_loaded``), from ``model_init_kwargs['quantization_config']`` or the trainer's
``quantization_config``: the base's linear layers are bitsandbytes', the adapter's saved weights load onto them
trainable, the base frozen, a step moves the adapter and no base weight, with the I5 and I10 guards on (the 4-bit
layers compute in fp32, as this project's QLoRA recipe on CPU; the adapter in bf16, to which TRL casts a quantized
model's adapter); and quantization set twice, refused before any weights load.
On the tiny random Llama over the SmolLM2 tokenizer."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

import grpotrl
from grpotrl.errors import InputError

from conftest import arithmetic_prompts, length_reward

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights=False)  # B not 0: the saved weights are told apart from a fresh adapter's
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


@pytest.fixture
def trained_adapter(tiny_llama, tmp_path):
    """A LoRA adapter on ``tiny_llama`` as an SFT saves it (adapter_config.json and adapter_model.safetensors), its
    A and B random (trained), and those saved tensors by their names in the loaded model's ``default`` adapter."""
    from safetensors.torch import load_file

    torch.manual_seed(1)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), peft.LoraConfig(**LORA))
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")  # keys without the adapter name
    return str(tmp_path / "adapter"), {k.replace(".weight", ".default.weight"): v for k, v in saved.items()}


def _sft_rows(n=4):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                               "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)])


def _check_loaded_quantized(model, saved: dict) -> dict:
    """The model TRL trains: a PeftModel whose adapted layers wrap bitsandbytes 4-bit layers (their CPU kernel
    pinned, ``pin_quantized_kernels``), the adapter's saved weights loaded, exactly those trainable; TRL's ``ref``
    copy of the adapter (beta > 0) bit for bit the adapter. Returns every parameter's value before training."""
    assert isinstance(model, peft.PeftModel)
    base = model.get_base_model()
    assert getattr(base, "is_loaded_in_4bit", False)
    layers = {n: m for n, m in base.named_modules() if n.endswith(("q_proj", "v_proj", "k_proj", "o_proj"))}
    quantized = [m.base_layer if n.endswith(("q_proj", "v_proj")) else m for n, m in layers.items()]
    assert len(quantized) == 8 and all(isinstance(m, bnb.nn.Linear4bit) for m in quantized), \
        {n: type(m).__name__ for n, m in layers.items()}
    assert not any(m.support_avx512bf16_for_cpu for m in quantized)  # pinned: an eval forward never repacks them
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == set(saved), sorted(trainable ^ set(saved))  # the adapter's tensors, nothing of the base
    # the saved weights, in bf16: TRL casts a quantized model's trainable weights to bf16 (QLoRA's adapter dtype)
    assert all(params[n].dtype == torch.bfloat16 and torch.equal(params[n].detach(), saved[n].to(torch.bfloat16))
               for n in saved), {n: params[n].dtype for n in saved}
    refs = {n: n.replace(".default.", ".ref.") for n in saved if n.replace(".default.", ".ref.") in params}
    assert all(params[r].dtype == params[n].dtype and torch.equal(params[r], params[n]) for n, r in refs.items()), \
        {r: params[r].dtype for r in refs.values()}  # TRL cast the adapter to bf16 after copying it (fp32) as ref
    return {n: p.detach().clone() for n, p in params.items()}


def _check_trained(model, before: dict, saved: dict) -> None:
    after = dict(model.named_parameters())
    assert any(not torch.equal(after[n], before[n]) for n in saved), "the adapter did not move"
    moved = [n for n in before if n not in saved and not torch.equal(after[n], before[n])]
    assert not moved, f"base weights moved: {moved}"


@pytest.mark.parametrize("where", ["model_init_kwargs", "trainer argument", "a PeftModel passed in"])
def test_I5_I10_grpo_on_an_adapter_dir_over_a_4bit_base_trains_the_saved_adapter(trained_adapter, tiny_llama, grpo_args,
                                                                                 where):
    """GRPO on the adapter directory with a 4-bit quantization (or on that adapter loaded onto its 4-bit base and
    passed in): one step at beta > 0 with every guard on. I10: TRL's ``ref`` copy of the adapter is the policy at
    step 0 token for token, to fp32's 1e-4 nats (the bf16 statistics the guard applies here also pass a reference
    that kept the adapter's fp32 weights, 2e-3 nats off on this model: ``trainers.adapter.reference_in_adapter_dtype``);
    I5 holds; the adapter moves, no base weight does."""
    path, saved = trained_adapter
    config = BitsAndBytesConfig(**NF4)
    model, quantization = path, {}
    if where == "a PeftModel passed in":
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, path, is_trainable=True)
    elif where == "trainer argument":
        quantization = {"quantization_config": config}
    args = grpo_args(max_steps=1, learning_rate=1e-2, max_completion_length=6,
                     model_init_kwargs={"quantization_config": config} if where == "model_init_kwargs" else None)
    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(8), **quantization)
    assert "ref" in trainer.model.peft_config  # TRL's copy of the adapter, the KL's reference at beta > 0
    before = _check_loaded_quantized(trainer.model, saved)
    assert trainer.guard_tolerances.low_precision  # the adapter computes in bf16: the guards' bf16 statistics
    trainer.train()
    logs = trainer.state.log_history
    gaps = [e["guards/logprob_max_gap"] for e in logs if "guards/logprob_max_gap" in e]
    assert gaps and max(gaps) < trainer.args.guard_logprob_atol  # I5 ran and held
    identity = [e["identity/step0_ref_logp_gap/max"] for e in logs if "identity/step0_ref_logp_gap/max" in e]
    assert identity and identity[0] <= 1e-4, identity  # I10 ran; the reference is the policy
    _check_trained(trainer.model, before, saved)


@pytest.mark.parametrize("where", ["model_init_kwargs", "trainer argument"])
def test_sft_on_an_adapter_dir_over_a_4bit_base_trains_the_saved_adapter(trained_adapter, tmp_path, where):
    path, saved = trained_adapter
    config = BitsAndBytesConfig(**NF4)
    args = grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, report_to="none", use_cpu=True,
                             guard_steps=-1, learning_rate=1e-2, per_device_train_batch_size=4, save_strategy="no",
                             model_init_kwargs={"quantization_config": config} if where == "model_init_kwargs"
                             else None)
    trainer = grpotrl.SFTTrainer(model=path, args=args, train_dataset=_sft_rows(),
                                 **({"quantization_config": config} if where == "trainer argument" else {}))
    before = _check_loaded_quantized(trainer.model, saved)
    trainer.train()
    _check_trained(trainer.model, before, saved)


# ---------------------------------------------------------------------------------------------
# Quantization set twice: refused before any weights load
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", ["grpo", "sft"])
@pytest.mark.parametrize("model", ["an adapter dir", "a plain model"])
def test_quantization_set_in_model_init_kwargs_and_as_the_trainer_argument_is_refused_before_the_load(
        trained_adapter, tiny_llama, grpo_args, tmp_path, monkeypatch, trainer, model):
    """Both the trainer's ``quantization_config`` and ``model_init_kwargs['quantization_config']`` (TRL's trainers
    take one only; on a model path they raise a ValueError naming neither value): on an adapter dir or a plain model
    path, GRPO or SFT, one InputError from the preflight before any weights load, with what, both values as
    written, and what to do."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was validated")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)  # what TRL's create_model_from_path reaches
    path = trained_adapter[0] if model == "an adapter dir" else tiny_llama
    lora = {} if model == "an adapter dir" else {"peft_config": peft.LoraConfig(r=4, target_modules=["q_proj"])}
    init = {"quantization_config": {"load_in_8bit": True}}
    given = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    match = (r"quantization is set twice: the trainer's quantization_config=BitsAndBytesConfig\("
             r"bnb_4bit_quant_type='nf4', load_in_4bit=True\) and args.model_init_kwargs\['quantization_config'\]="
             r"\{'load_in_8bit': True\}; .* Set it in one place: keep the trainer argument .* and drop "
             r"quantization_config from model_init_kwargs")
    with pytest.raises(InputError, match=match):
        if trainer == "grpo":
            grpotrl.GRPOTrainer(model=path, reward_funcs=length_reward, args=grpo_args(model_init_kwargs=init),
                                train_dataset=arithmetic_prompts(8), quantization_config=given, **lora)
        else:
            grpotrl.SFTTrainer(model=path, args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), report_to="none",
                                                                  use_cpu=True, model_init_kwargs=init),
                               train_dataset=_sft_rows(), quantization_config=given, **lora)


def test_I10_the_ref_copy_is_cast_by_its_name_s_ref_component_a_parameter_dict_s_too(tiny_llama):
    """``reference_in_adapter_dtype`` on a LoRA over q_proj and the token embedding (PEFT holds the embedding's
    LoRA weights in a ParameterDict: ``...lora_embedding_A.ref``, no trailing dot), its ``ref`` copy in fp32 and the
    trained ``default`` in bf16, as TRL's QLoRA cast leaves them: every ``ref`` tensor takes its twin's dtype."""
    from peft import LoraConfig, get_peft_model

    from grpotrl.trainers.adapter import reference_in_adapter_dtype

    config = LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), config)
    model.add_adapter("ref", config)
    for name, p in model.named_parameters():
        if "default" in name.split("."):
            p.data = p.data.to(torch.bfloat16)
    params = dict(model.named_parameters())
    refs = [n for n in params if "ref" in n.split(".")]
    assert any(n.endswith("lora_embedding_A.ref") for n in refs), refs  # the ParameterDict case is there
    assert reference_in_adapter_dtype(model) == len(refs)
    assert {params[n].dtype for n in refs} == {torch.bfloat16}
