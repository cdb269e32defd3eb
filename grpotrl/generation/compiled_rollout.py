"""The compiled rollout (``compiled_rollout``): transformers' ``generate`` with a static KV cache and its
decoding step compiled, through transformers' own compile path. The decisions only; the trainer wires them
(``trainers/grpo.py``) and ``trainers/_intercept.py`` holds the one run-time wrap it needs.

TRL builds its ``GenerationConfig`` with ``disable_compile=True``, so its rollout runs eagerly: one small kernel
launch after another. With the compiled rollout on, each ``generate`` call of the GRPO rollout gets
(``generate_kwargs``): ``cache_implementation="static"``, ``disable_compile=False``, a ``CompileConfig``
(``compile_config``: CUDA graphs on CUDA, ``mode="default"`` elsewhere, shapes static) and a ``max_cache_len``
of ``max_new_tokens`` plus the prompt width rounded up to a bucket (``cache_length``). transformers 5.24 then compiles the decoding forward
(``GenerationMixin._sample``: ``get_compiled_call`` when ``_valid_auto_compile_criteria`` holds) and sizes the
static cache as the largest of the call's ``max_length``, ``max_cache_len`` and every earlier call's size
(``_prepare_static_cache``): the cache length, the decoding step's only varying shape at a fixed generation
batch, takes a few bucket values over a run, and the step compiles once per value. Under ``dynamic=False`` a
cache length dynamo has not seen compiles a new graph; dynamo's ``recompile_limit`` (8) caps them per model.

Prefill is not compiled (transformers runs it eagerly: its width changes every call). grpotrl's logits
processors and the sampler-logprob recorder run in the decoding loop, outside the compiled forward, unchanged.

``resolve`` turns the config's setting into on or off: ``"auto"`` is on only on ``MEASURED_FASTER_ON`` (CUDA:
on an H100 in bf16 the GRPO step after the guard steps took 0.296x plain TRL's, docs/cost.md) and only in runs
like the measured one (``unmeasured``: no DeepSpeed, no adapter), ``"true"`` on any device (on CPU through
``CompileConfig._compile_all_devices``), and what cannot work is refused (``refusal``).
"""

from __future__ import annotations

import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationConfig

from ..errors import InputError

# device types where 'auto' is on: the GRPO step measured faster with the compiled rollout than with TRL's eager
# one (docs/cost.md: an H100 in bf16, 0.296x; CPU was not measured faster)
MEASURED_FASTER_ON: tuple[str, ...] = ("cuda",)
MIN_BUCKET = 64  # the smallest prompt bucket (cache_length)
# device types where the stop decision is read one step late (transformers' DeferredStopCheck), so that the host
# never waits on the device inside the loop: it needs torch.Event on the device (CPU has none)
DEFERRED_STOP_ON = ("cuda",)
# device types where the sampling step draws without torch.multinomial's per-call read of a validity flag
# (trainers._intercept.inject_draw_one: the same tokens); on CPU that read costs nothing
SYNC_FREE_DRAW_ON = ("cuda",)


def parse_setting(value) -> bool | str:
    """A true / false / 'auto' setting of the config (``compiled_rollout``; ``padding_free`` and
    ``balance_microbatches``, whose ``trainers.padding_free`` reads it from here) as ``True``, ``False`` or
    ``"auto"``: a recipe or command line may give a bool or a string, and ``configs.checks`` refused anything else.

    >>> parse_setting("True"), parse_setting("auto"), parse_setting(False)
    (True, 'auto', False)
    """
    if isinstance(value, str):
        low = value.strip().lower()
        return "auto" if low == "auto" else low == "true"
    return bool(value)


def bucket_length(n: int, ceiling: int | None = None) -> int:
    """The bucket of ``n`` (a padded prompt width, ``cache_length``): the smallest of 64, 96, 128, 192, 256, 384,
    512, ... (``2**k`` and ``1.5 * 2**k``, from ``MIN_BUCKET``) that holds ``n``: at most 1.5x ``n``, about two
    compiles per doubling of the widest prompt. ``ceiling`` caps the bucket, never below ``n``.

    >>> [bucket_length(n) for n in (1, 64, 65, 97, 129, 200, 300, 600)]
    [64, 64, 96, 128, 192, 256, 384, 768]
    >>> bucket_length(600, ceiling=512), bucket_length(500, ceiling=512)
    (600, 512)
    """
    if n < 1:
        raise InputError(f"bucket_length: needs n >= 1 positions, got {n}.")
    k = (-(-n // MIN_BUCKET) - 1).bit_length()  # the smallest k with MIN_BUCKET * 2**k >= n
    size = MIN_BUCKET * 2 ** k
    if k and size * 3 // 4 >= n:
        size = size * 3 // 4  # 1.5 * 2**(k-1) * MIN_BUCKET
    return max(n, min(size, ceiling)) if ceiling is not None else size


def compile_config(device_type: str, fullgraph: bool) -> CompileConfig:
    """transformers' ``CompileConfig`` for the decoding step on ``device_type``: ``mode="reduce-overhead"``
    (CUDA graphs) on CUDA, ``"default"`` elsewhere; ``dynamic=False`` (each cache bucket its own static graph,
    as CUDA graphs need); ``fullgraph`` where the model declares it can (``_can_compile_fullgraph``), else graph
    breaks run eagerly. Off CUDA/XPU ``_compile_all_devices`` lets transformers compile at all (it compiles
    on accelerators only otherwise). Build one per trainer: transformers recompiles when the config changes."""
    config = CompileConfig(fullgraph=fullgraph, dynamic=False,
                           mode="reduce-overhead" if device_type == "cuda" else "default")
    if device_type not in ("cuda", "xpu"):
        config._compile_all_devices = True
    return config


def cache_length(prompt_width: int, max_new_tokens: int, ceiling: int | None = None) -> int:
    """The static cache length for a ``generate`` call of ``prompt_width`` padded prompt columns and up to
    ``max_new_tokens`` new ones: ``max_new_tokens`` plus the prompt width rounded up to its bucket
    (``bucket_length``). Only the prompt width varies over a run (``max_new_tokens`` is the config's), so the
    cache takes one length per prompt bucket, and holds at most the prompt's bucket slack beyond what the call
    needs: 256 new tokens after a 50-column prompt take 320 positions, where rounding the 306 up as a whole took
    384 (every position is a key and a value per row and layer, which the decoding step attends over).
    ``ceiling`` (the model's context length) caps it, never below what the call needs.

    >>> cache_length(50, 256), cache_length(65, 256), cache_length(50, 256, ceiling=300)
    (320, 352, 306)
    """
    n = prompt_width + max_new_tokens
    size = max_new_tokens + bucket_length(max(prompt_width, 1))
    return max(n, min(size, ceiling)) if ceiling is not None else size


def generate_kwargs(config: CompileConfig, prompt_width: int, max_new_tokens: int,
                    ceiling: int | None = None) -> dict:
    """The keyword arguments that turn one ``generate`` call (``prompt_width`` padded prompt columns, up to
    ``max_new_tokens`` new ones) into the compiled rollout: a static cache of ``cache_length`` positions
    (transformers keeps the largest size any call asked for), compiled through ``config``.

    >>> kw = generate_kwargs(CompileConfig(), prompt_width=40, max_new_tokens=64)
    >>> kw["cache_implementation"], kw["max_cache_len"], kw["disable_compile"]
    ('static', 128, False)
    """
    return {"cache_implementation": "static",
            "max_cache_len": cache_length(prompt_width, max_new_tokens, ceiling),
            "compile_config": config, "disable_compile": False}


def graphs_traced() -> int:
    """How many graphs torch.compile has traced in this process (dynamo's ``unique_graphs`` counter): a
    ``generate`` call that raised it traced its decoding step. Such a call leaves its static cache referenced from
    dynamo's trace state, a reference cycle (measured on CPU, torch 2.13: the first call's cache alive after
    three calls, freed by ``gc.collect()``), which Python's cyclic collector frees at a time of its own: the
    trainer collects once after such a call (``trainers/grpo.py``, ``_compiled_generate``), so that the cache
    (rows x cache length x layers x keys and values: 675 MiB for 64 rows x 320 positions of SmolLM2 under bf16
    autocast over fp32 weights, where the keys are fp32 and the values bf16) is
    not held through the loss's forward and backward."""
    return counters["stats"]["unique_graphs"]


def model_facts(model) -> dict:
    """What ``refusal`` needs to know of a loaded model (the generating module: the base model under PEFT; None:
    none found, which takes no static cache):
    ``quantizer`` (the class name of a quantizer whose kernels transformers cannot compile, else None),
    ``offloaded`` (parts of it on CPU or disk under a ``device_map``), ``static_cache`` (transformers can give
    it a static cache) and ``fullgraph`` (it declares its forward compilable as one graph)."""
    if model is None:
        return {"quantizer": None, "offloaded": False, "static_cache": False, "fullgraph": False}
    quantizer = getattr(model, "hf_quantizer", None)
    devices = set(getattr(model, "hf_device_map", {}).values()) if hasattr(model, "hf_device_map") else set()
    supports_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    return {
        "quantizer": type(quantizer).__name__ if quantizer is not None and not quantizer.is_compileable else None,
        "offloaded": "disk" in devices or ("cpu" in devices and len(devices) > 1),
        "static_cache": bool(supports_cache()) if supports_cache is not None else False,
        "fullgraph": bool(getattr(model, "_can_compile_fullgraph", False)),
    }


def refusal(*, hf_generate: bool, tools: bool, cache_implementation, is_vlm: bool, sharded: bool,
            facts: dict) -> str | None:
    """Why the compiled rollout cannot run here, or None where it can. ``hf_generate``: the rollout is
    transformers' ``generate`` (not vLLM, continuous batching or a ``rollout_func``); ``tools``: a multi-turn
    tool loop; ``cache_implementation``: the generation config's; ``is_vlm``: a multimodal processing class;
    ``sharded``: FSDP or DeepSpeed ZeRO-3 (parameters gathered per call, and transformers' ``synced_gpus``
    loop reads a flag from every rank at every step); ``facts``: ``model_facts``."""
    if not hf_generate:
        return "the rollout is not transformers' generate (vLLM, continuous batching or a rollout_func)"
    if not hasattr(GenerationConfig(), "max_cache_len"):
        return (f"transformers {transformers.__version__} has no GenerationConfig.max_cache_len, through which the "
                "cache length is bucketed (transformers 5.24 has it)")
    if tools:
        return "tools run a multi-turn tool loop of generate calls, which grpotrl does not compile"
    if cache_implementation not in (None, "static"):
        return (f"cache_implementation={cache_implementation!r}: the compiled rollout needs transformers' static "
                "cache")
    if is_vlm:
        return "the processing class is multimodal, whose generate grpotrl has not checked under a static cache"
    if sharded:
        return ("FSDP or DeepSpeed ZeRO-3 gather the parameters per generate call and make every decoding step "
                "read a flag from every rank")
    if facts["quantizer"] is not None:
        return f"the model's quantizer ({facts['quantizer']}) has kernels transformers cannot compile"
    if facts["offloaded"]:
        return "parts of the model are offloaded to CPU or disk (device_map), which transformers does not compile"
    if not facts["static_cache"]:
        return "the model takes no static KV cache in transformers' generate"
    return None


def unmeasured(deepspeed: bool, adapter: bool) -> str | None:
    """What of a run the measurement that turned ``"auto"`` on did not cover (None: nothing): it ran one process
    without DeepSpeed (``deepspeed``) on a full model (``adapter``: a PEFT adapter on it).

    >>> unmeasured(False, False), unmeasured(True, False)
    (None, 'the compiled rollout was not measured under DeepSpeed')
    """
    if deepspeed:
        return "the compiled rollout was not measured under DeepSpeed"
    if adapter:
        return "the compiled rollout was not measured with a PEFT adapter"
    return None


def resolve(setting, device_type: str, why_not: str | None, not_covered: str | None = None) -> tuple[bool, str | None]:
    """Whether the rollout is compiled (``setting``: the config's ``compiled_rollout``) on a device of
    ``device_type`` (``torch.device.type``), and why not where it asked for ``"auto"`` and it is off.
    ``why_not``: ``refusal``'s answer; ``not_covered``: ``unmeasured``'s. ``"auto"`` is on only on
    ``MEASURED_FASTER_ON`` where nothing is refused and the measurement covers the run; ``"true"`` on any device,
    an ``InputError`` where something is refused.

    >>> resolve("auto", "cuda", None), resolve("auto", "cpu", None)
    ((True, None), (False, "not measured faster than TRL's eager rollout on cpu; see docs/cost.md"))
    >>> resolve("auto", "cuda", None, "the compiled rollout was not measured under DeepSpeed")
    (False, 'the compiled rollout was not measured under DeepSpeed; see docs/cost.md')
    >>> resolve("true", "cpu", None)
    (True, None)
    """
    want = parse_setting(setting)
    if want is False:
        return False, None
    if why_not is not None:
        if want is True:
            raise InputError(f"compiled_rollout=true: {why_not}. Set compiled_rollout: false (or 'auto', which turns "
                             "it off here).")
        return False, why_not
    if want == "auto" and device_type not in MEASURED_FASTER_ON:
        return False, f"not measured faster than TRL's eager rollout on {device_type}; see docs/cost.md"
    if want == "auto" and not_covered is not None:
        return False, f"{not_covered}; see docs/cost.md"
    return True, None


def startup_line(setting, device_type: str, on: bool, why: str | None) -> str:
    """The line a trainer logs once at init: what ``compiled_rollout`` resolved to on ``device_type`` and why
    (that the finished-row rollout is off under it is ``padding_free.startup_line``'s to say).

    >>> startup_line("auto", "cpu", False, "not measured faster ...")
    'grpotrl: compiled rollout off (auto: not measured faster ...)'
    >>> startup_line("true", "cpu", True, None)
    'grpotrl: compiled rollout on (set true: static KV cache, decoding step compiled, mode default)'
    """
    asked = parse_setting(setting)
    how = "auto" if asked == "auto" else f"set {str(asked).lower()}"
    if on:
        mode = "reduce-overhead" if device_type == "cuda" else "default"
        deferred = ", stop read one step late" if device_type in DEFERRED_STOP_ON else ""
        return f"grpotrl: compiled rollout on ({how}: static KV cache, decoding step compiled, mode {mode}{deferred})"
    return f"grpotrl: compiled rollout off ({how}{': ' + why if why else ''})"
