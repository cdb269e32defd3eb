"""The compiled rollout (``generation.compiled_rollout``): a static KV cache and transformers' compiled decoding
step sample what the eager rollout samples, with grpotrl's processors and recorder in the loop; the cache length is
bucketed so that a run compiles a few times; 'auto' is off until a device is measured; what cannot work is refused.

The compiles here are inductor's real ones on CPU (``_compile_all_devices``): about 16 s for the tiny model's
decoding step on 2 cores, once per cache bucket and model (inductor's on-disk cache makes reruns faster)."""

import gc
import weakref

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import transformers
import trl
from conftest import arithmetic_prompts, length_reward
from peft import LoraConfig
from test_finished_rows import StopAt
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor
from transformers.cache_utils import StaticCache

import grpotrl
from grpotrl.errors import InputError
from grpotrl.generation import compiled_rollout
from grpotrl.generation.processors import build_processors
from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder
from grpotrl.trainers import _intercept

MAX_NEW = 16
# fp32, CPU: the compiled step's logprobs against the eager step's, per token (measured: at most 1.4e-6 on the
# tiny Llama; inductor fuses the attention and MLP arithmetic in another order)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_and_batch(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    batch = tok(["1 + 1 =", "What is two plus three, in words?", "Hi", "Count: 1 2 3"], return_tensors="pt",
                padding=True)
    return model, tok, batch


def _generate(model, tok, batch, compiled, processors=(), **sampling):
    """(sequences [B, P + C], the recorder's logprobs [B, C], the recorder) of one ``generate`` call, eager or
    compiled."""
    recorder = SampledLogprobRecorder()
    extra = {}
    if compiled:
        config = compiled_rollout.compile_config("cpu", fullgraph=True)
        extra = compiled_rollout.generate_kwargs(config, batch["input_ids"].size(1), MAX_NEW)
    torch.manual_seed(0)
    with torch.no_grad(), _intercept.inject_recorders_after_warpers(model):
        out = model.generate(**batch, max_new_tokens=MAX_NEW, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, logits_processor=[*processors, recorder],
                             **sampling, **extra)
    return out, recorder.logprobs(out), recorder


SAMPLINGS = {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, temperature=0.7, top_k=0),
             "top_p": dict(do_sample=True, temperature=1.0, top_p=0.9, top_k=0)}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_I5_compiled_rollout_samples_the_eager_rollouts_tokens_and_logprobs(model_and_batch, sampling):
    """Greedy and seeded sampling: the same tokens, and the sampler's recorded logprobs within fp32 rounding of
    the compiled arithmetic (``LOGPROB_ATOL``). The decoding step really ran compiled (transformers'
    ``_compiled_call``), through a static cache."""
    model, tok, batch = model_and_batch
    eager, eager_lp, _ = _generate(model, tok, batch, compiled=False, **SAMPLINGS[sampling])
    compiled, compiled_lp, _ = _generate(model, tok, batch, compiled=True, **SAMPLINGS[sampling])
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, eager)
    finite = torch.isfinite(eager_lp)
    assert torch.equal(finite, torch.isfinite(compiled_lp))
    assert (compiled_lp - eager_lp)[finite].abs().max() < LOGPROB_ATOL


def test_I6_processors_are_honoured_under_the_compiled_rollout(model_and_batch):
    """Response-only presence, frequency and repetition penalties and min-new-tokens run in the loop, outside
    the compiled forward: the compiled rollout samples what the eager one samples with them, and no stop id
    appears before the minimum."""
    model, tok, batch = model_and_batch
    P = batch["input_ids"].size(1)

    def processors():
        return build_processors(P, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                                min_new_tokens=4, stop_ids=[tok.eos_token_id, tok.pad_token_id])

    eager, eager_lp, _ = _generate(model, tok, batch, compiled=False, processors=processors(), **SAMPLINGS["sampled"])
    compiled_procs = processors()
    compiled, compiled_lp, _ = _generate(model, tok, batch, compiled=True, processors=compiled_procs,
                                      **SAMPLINGS["sampled"])
    assert torch.equal(compiled, eager)
    finite = torch.isfinite(eager_lp)
    assert (compiled_lp - eager_lp)[finite].abs().max() < LOGPROB_ATOL
    assert not torch.isin(compiled[:, P:P + 4], torch.tensor([tok.eos_token_id, tok.pad_token_id])).any()
    assert compiled_procs[-1].triggered is not None  # min-new-tokens ran in the compiled loop


class _HostEvent:
    """``torch.Event`` for CPU, where torch has none: CPU work is done when queued, so recording and waiting
    are no-ops. Lets transformers' ``DeferredStopCheck`` run on CPU here."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


def test_I5_deferred_stop_check_undoes_its_extra_step(model_and_batch, monkeypatch):
    """``_intercept.inject_deferred_stop_check`` (the compiled rollout's on CUDA; here on CPU with a host event):
    transformers reads the stop flag one step late and runs one forward more, whose token it drops. The
    sequences and the recorder's logprobs are the plain loop's; the recorder saw the extra step; the wrap is
    restored after the block."""
    from transformers.generation.utils import DeferredStopCheck

    model, tok, batch = model_and_batch
    P = batch["input_ids"].size(1)
    stopping = dict(do_sample=True, temperature=0.7, top_k=0)
    plain, plain_lp, _ = _generate(model, tok, batch, compiled=True, processors=[StopAt([1, 3, 3, 6], P,
                                                                                        tok.eos_token_id)], **stopping)
    assert plain.size(1) - P == 7  # every row stopped by step 6: the stop flag ended the loop
    monkeypatch.setattr(torch, "Event", _HostEvent)
    original = DeferredStopCheck.is_supported
    with _intercept.inject_deferred_stop_check(("cpu",)):
        assert DeferredStopCheck.is_supported(torch.device("cpu"), None, False, False)
        assert not DeferredStopCheck.is_supported(torch.device("cpu"), None, False, True)  # an assistant: never
        deferred, deferred_lp, recorder = _generate(model, tok, batch, compiled=True,
                                                    processors=[StopAt([1, 3, 3, 6], P, tok.eos_token_id)], **stopping)
    assert DeferredStopCheck.is_supported is original
    assert not DeferredStopCheck.is_supported(torch.device("cpu"), None, False, False)
    assert torch.equal(deferred, plain)
    assert torch.equal(deferred_lp, plain_lp)
    C = plain.size(1) - batch["input_ids"].size(1)
    # the recorder kept one step more than the C columns returned: the step transformers undid
    assert len(recorder._steps) == C + 1 or (len(recorder._steps) == C and recorder._pending is not None)


class NaNAt(LogitsProcessor):
    """Scores of NaN in row 1 at decoding step ``step`` (a broken processor upstream of the sampler)."""

    def __init__(self, step: int, prompt_width: int):
        self.step, self.prompt_width = step, prompt_width

    def __call__(self, input_ids, scores):
        if input_ids.size(1) - self.prompt_width == self.step:
            scores = scores.clone()
            scores[1] = float("nan")
        return scores


@pytest.mark.parametrize("defer_check", [True, False])
def test_I5_injected_draw_samples_torchs_tokens_and_still_refuses_nan(model_and_batch, defer_check):
    """``_intercept.inject_draw_one`` (the compiled rollout's sampling step on CUDA with the check deferred; every
    CPU rollout's with it at once): transformers' loop, seeded, samples the very tokens torch.multinomial does, and
    the recorder the same logprobs; a NaN distribution at step 3 still fails generate with torch's words (after the
    loop where the check is deferred); torch.multinomial is restored."""
    model, tok, batch = model_and_batch
    sampled = SAMPLINGS["sampled"]
    plain, plain_lp, _ = _generate(model, tok, batch, compiled=False, **sampled)
    original = torch.multinomial
    with _intercept.inject_draw_one(defer_check):
        assert torch.multinomial is not original
        drawn, drawn_lp, _ = _generate(model, tok, batch, compiled=False, **sampled)
    assert torch.multinomial is original
    assert torch.equal(drawn, plain) and torch.equal(drawn_lp, plain_lp)
    P = batch["input_ids"].size(1)
    with pytest.raises(RuntimeError, match="inf.*nan.*element < 0"):
        _generate(model, tok, batch, compiled=False, processors=[NaNAt(3, P)], **sampled)  # torch's own check
    after = ".*read once after generate" if defer_check else r".*\(torch.multinomial's check\)$"
    with pytest.raises(RuntimeError, match="inf.*nan.*element < 0" + after):
        with _intercept.inject_draw_one(defer_check):
            _generate(model, tok, batch, compiled=False, processors=[NaNAt(3, P)], **sampled)
    assert torch.multinomial is original


def test_the_cache_length_is_bucketed_so_several_prompt_widths_compile_once(model_and_batch):
    """Three prompt widths (padded to 5, 20 and 40 columns, 16 new tokens: 21, 36 and 56 cache positions, each
    longer than the last) share the 64-column prompt bucket, a cache of 16 + 64 positions: the decoding step
    compiles one graph. Without the bucket, each call's static cache would have its own length and compile its
    own graph."""
    model, tok, _ = model_and_batch
    assert [compiled_rollout.cache_length(P, MAX_NEW) for P in (5, 20, 40)] == [80, 80, 80]
    torch._dynamo.reset()
    model._previous_max_cache_length = -1  # transformers' running size (its own attribute), as a new model has
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    sizes = []
    for width in (5, 20, 40):
        ids = torch.randint(10, 1000, (4, width))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        out, _, _ = _generate(model, tok, batch, compiled=True, do_sample=False)
        sizes.append(model._previous_max_cache_length)
        assert out.size(1) > width
    assert sizes == [80, 80, 80]
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before == 1


def test_bucket_lengths():
    """64, then 2**k and 1.5 * 2**k: at most 1.5x the positions a call needs, never below it."""
    assert [compiled_rollout.bucket_length(n) for n in (1, 64, 65, 96, 97, 128, 129, 192, 193, 1000)] == \
        [64, 64, 96, 96, 128, 128, 192, 192, 256, 1024]
    assert all(n <= compiled_rollout.bucket_length(n) <= max(64, 1.5 * n) for n in range(1, 5000))
    assert compiled_rollout.bucket_length(700, ceiling=512) == 700
    with pytest.raises(InputError):
        compiled_rollout.bucket_length(0)


def test_cache_length_rounds_the_prompt_width_only():
    """The cache holds ``max_new_tokens`` plus the prompt's bucket: never below what a call needs, at most the
    prompt's bucket slack above it (1.5x the prompt width, or 64 columns), capped by the model's context length
    where that still holds the call. 256 new tokens after a 50-column prompt: 320 positions (rounding the 306 as
    a whole gave 384)."""
    assert compiled_rollout.cache_length(50, 256) == 320
    assert compiled_rollout.cache_length(65, 256) == 256 + 96
    for new in (1, 16, 256, 1000):
        for width in range(1, 700):
            size = compiled_rollout.cache_length(width, new)
            assert width + new <= size <= new + max(64, 1.5 * width), (width, new, size)
    assert compiled_rollout.cache_length(50, 256, ceiling=310) == 310
    assert compiled_rollout.cache_length(50, 256, ceiling=300) == 306  # the call's own need beats the ceiling
    assert len({compiled_rollout.cache_length(w, 256) for w in range(1, 513)}) == 7  # 64 ... 512: seven graphs


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu"])
def test_auto_is_on_only_where_measured_faster_and_in_runs_like_the_measured_one(device):
    """'auto' is on on CUDA (an H100 in bf16: the step 0.296x plain TRL's, docs/cost.md), off elsewhere with the
    reason; off under DeepSpeed or an adapter, which the measurement did not cover; 'true' is honoured anyway."""
    assert compiled_rollout.MEASURED_FASTER_ON == ("cuda",)
    on, why = compiled_rollout.resolve("auto", device, None)
    if device == "cuda":
        assert on and why is None
    else:
        assert not on and why == f"not measured faster than TRL's eager rollout on {device}; see docs/cost.md"
    for deepspeed, adapter, words in ((True, False, "DeepSpeed"), (False, True, "PEFT adapter")):
        not_covered = compiled_rollout.unmeasured(deepspeed, adapter)
        assert words in not_covered
        on, why = compiled_rollout.resolve("auto", device, None, not_covered)
        assert not on and (words in why) == (device == "cuda")
        assert compiled_rollout.resolve("true", device, None, not_covered) == (True, None)
    assert compiled_rollout.unmeasured(False, False) is None
    assert compiled_rollout.resolve("true", device, None) == (True, None)
    assert compiled_rollout.resolve("false", device, None) == (False, None)
    assert compiled_rollout.resolve(False, device, None) == (False, None)


def test_compile_config_per_device():
    cuda = compiled_rollout.compile_config("cuda", fullgraph=True)
    assert cuda.mode == "reduce-overhead" and cuda.dynamic is False and cuda.fullgraph and not cuda._compile_all_devices
    cpu = compiled_rollout.compile_config("cpu", fullgraph=False)
    assert cpu.mode == "default" and cpu._compile_all_devices and not cpu.fullgraph


FACTS = {"quantizer": None, "offloaded": False, "static_cache": True, "fullgraph": True}


@pytest.mark.parametrize("case, words", [
    (dict(hf_generate=False), "not transformers' generate"),
    (dict(tools=True), "tools"),
    (dict(cache_implementation="dynamic"), "cache_implementation='dynamic'"),
    (dict(is_vlm=True), "multimodal"),
    (dict(sharded=True), "ZeRO-3"),
    (dict(facts={**FACTS, "quantizer": "Bnb4BitHfQuantizer"}), "Bnb4BitHfQuantizer"),
    (dict(facts={**FACTS, "offloaded": True}), "offloaded"),
    (dict(facts={**FACTS, "static_cache": False}), "static KV cache"),
])
def test_refusals_name_the_setting_and_what_to_do(case, words):
    """'true' where it cannot work is an InputError naming the setting, why, and what to set; 'auto' is off
    there with the same reason."""
    kw = dict(hf_generate=True, tools=False, cache_implementation=None, is_vlm=False, sharded=False, facts=FACTS)
    why = compiled_rollout.refusal(**{**kw, **case})
    assert why is not None and words in why
    with pytest.raises(InputError, match=r"compiled_rollout=true: .*Set compiled_rollout: false"):
        compiled_rollout.resolve("true", "cuda", why)
    assert compiled_rollout.resolve("auto", "cuda", why) == (False, why)
    assert compiled_rollout.refusal(**{**kw, "cache_implementation": "static"}) is None


def test_the_config_takes_true_false_auto_and_trl_configs_keep_trls_rollout(tmp_path):
    assert grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True).compiled_rollout == "auto"
    assert grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, compiled_rollout=True).compiled_rollout is True
    with pytest.raises(InputError, match="compiled_rollout='sometimes': use true, false or 'auto'"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, compiled_rollout="sometimes")
    trl_args = grpotrl.configs.complete_grpo_config(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True))
    assert trl_args.compiled_rollout is False


class GraphCount(transformers.TrainerCallback):
    """dynamo's count of the graphs it compiled, and how many of the static caches that transformers made are
    alive, at each step's end."""

    def __init__(self, caches: list):
        self.graphs, self.caches, self.alive = [], caches, []

    def on_step_end(self, args, state, control, **kwargs):
        self.graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        self.alive.append(sum(ref() is not None for ref in self.caches))


def _track_static_caches(monkeypatch) -> list:
    """Weak references to every ``StaticCache`` transformers builds from here on."""
    made, init = [], StaticCache.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(StaticCache, "__init__", tracked)
    return made


def _input_grad_hooks(model) -> int:
    """How many of transformers' ``enable_input_require_grads`` hooks the model's input embeddings hold."""
    return sum(getattr(h, "__name__", "") == "make_inputs_require_grads"
               for h in model.get_input_embeddings()._forward_hooks.values())


def test_compiled_rollout_trains_with_guards_on_and_the_finished_row_rollout_off(tiny_llama, grpo_args, caplog,
                                                                                monkeypatch):
    """Four GRPO steps with ``compiled_rollout: true`` on CPU, gradient checkpointing on (TRL's default), every
    guard on every step (I1, I3-I5, I10, I11 pass: the sampler's logprobs are the trainer's within fp32),
    padding_free on (CPU's 'auto') but its finished-row rollout off, said at init; the rollout ran compiled and said
    so in its metric, and compiled once: TRL switches checkpointing off and on around each rollout, which stacked
    an input-embedding hook on the model at each switch, and the decoding step recompiled on their number at every
    step (``_intercept.skip_stacked_input_grad_hooks``). Each ``generate`` ran without the input-embedding gradient
    hook, whose ``requires_grad_`` torch 2.11's dynamo refuses in the compiled step (an H100 run stopped at its
    first rollout), and the training forwards keep the one that checkpointing needs. No static cache outlives its
    rollout, with Python's cyclic collector off: the call that traced the decoding step left its cache in dynamo's
    trace state (a reference cycle; alive at steps 1-4 without the trainer's ``gc.collect()``)."""
    graphs = GraphCount(_track_static_caches(monkeypatch))
    hooks_at_generate = []
    generate = transformers.GenerationMixin.generate

    def counting(self, *args, **kwargs):
        hooks_at_generate.append(_input_grad_hooks(self))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting)
    with caplog.at_level("INFO", logger="grpotrl.trainers.grpo"):
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                      args=grpo_args(compiled_rollout="true", max_steps=4), callbacks=[graphs])
    assert trainer.args.gradient_checkpointing
    assert trainer.compiled_rollout is not None and trainer.padding_free
    assert trainer._drops_finished_rows() is False
    assert "grpotrl: compiled rollout on (set true: static KV cache, decoding step compiled, mode default)" \
        in caplog.text
    assert "finished-row rollout off (compiled rollout on: its static KV cache keeps every row)" in caplog.text
    gc.disable()  # the cycle would otherwise be freed whenever the collector happens to run
    try:
        trainer.train()
    finally:
        gc.enable()
    assert len(graphs.graphs) == 4 and len(set(graphs.graphs)) == 1, graphs.graphs  # compiled at step 1, never again
    assert len(graphs.caches) == 4 and graphs.alive == [0] * 4, graphs.alive
    history = trainer.state.log_history
    assert [h["generation/compiled_rollout"] for h in history if "generation/compiled_rollout" in h] == [1.0] * 4
    assert all(h["generation/compiled_rollout_cache_len"] == 12 + 64 for h in history
               if "generation/compiled_rollout_cache_len" in h)
    assert not any("padding_free/decoding_rows" in h for h in history)
    assert any("guards/logprob_max_gap" in h for h in history)  # I5 ran (and passed: train() returned)
    assert hasattr(trainer.model, "_compiled_call")
    assert hooks_at_generate == [0] * 4 and _input_grad_hooks(trainer.model) == 1, hooks_at_generate


def test_auto_on_a_measured_device_leaves_an_adapters_rollout_eager_and_says_why(tiny_llama, grpo_args, caplog,
                                                                                   monkeypatch):
    """With CPU counted as measured, 'auto' compiles a full model's rollout and leaves a LoRA model's eager, saying
    why: the measurement that turned it on ran without an adapter."""
    monkeypatch.setattr(compiled_rollout, "MEASURED_FASTER_ON", ("cpu",))
    full = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                               args=grpo_args(max_steps=1))
    assert full.compiled_rollout is not None
    with caplog.at_level("INFO", logger="grpotrl.trainers.grpo"):
        lora = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                   args=grpo_args(max_steps=1),
                                   peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert lora.compiled_rollout is None
    assert "grpotrl: compiled rollout off (auto: the compiled rollout was not measured with a PEFT adapter; see " \
           "docs/cost.md)" in caplog.text


def test_auto_leaves_trls_eager_rollout_and_says_why(tiny_llama, grpo_args, caplog):
    with caplog.at_level("INFO", logger="grpotrl.trainers.grpo"):
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                      args=grpo_args(max_steps=1))
    assert trainer.compiled_rollout is None and trainer._drops_finished_rows()
    assert "grpotrl: compiled rollout off (auto: not measured faster than TRL's eager rollout on cpu; see " \
           "docs/cost.md)" in caplog.text


def test_true_with_another_cache_is_refused_at_init(tiny_llama, grpo_args):
    with pytest.raises(InputError, match=r"compiled_rollout=true: cache_implementation='dynamic'.*static cache"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                            args=grpo_args(compiled_rollout="true", cache_implementation="dynamic"))


def test_a_rollout_transformers_ran_eagerly_is_refused_and_an_old_transformers_is_refused(tiny_llama, grpo_args,
                                                                                         monkeypatch):
    """``compiled_rollout`` is honoured or refused: a ``generate`` that did not compile its decoding step
    (transformers' criteria said no, with only a warning) is an ``InputError`` naming the setting; a transformers
    without ``GenerationConfig.max_cache_len`` is refused before a model runs."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward,
                                  args=grpo_args(compiled_rollout="true"), train_dataset=arithmetic_prompts(8))
    with pytest.raises(InputError, match="compiled_rollout: transformers ran the rollout's decoding step eagerly"):
        trainer._check_compiled(trainer.model, [])

    class OldConfig:  # a GenerationConfig before max_cache_len
        pass

    monkeypatch.setattr(compiled_rollout, "GenerationConfig", OldConfig)
    why = compiled_rollout.refusal(hf_generate=True, tools=False, cache_implementation=None, is_vlm=False,
                                   sharded=False, facts={"quantizer": None, "offloaded": False, "static_cache": True})
    assert "GenerationConfig.max_cache_len" in why
