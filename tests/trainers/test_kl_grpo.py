"""KL estimators for grpotrl.GRPOTrainer: the KLFields GAD had, on every GRPO config.

TRL 1.16's in-loss k3 is unclamped: at log pi_ref - log pi = 100, exp overflows fp32, its value is inf
and its gradient NaN. grpotrl's own term (``GRPOTrainer._kl_loss``) clamps as verl does and equals
TRL's loss to rounding wherever the clamp is not active (the default: k3 in the loss).
"""
import logging
import re

import pytest
import torch
import trl
from conftest import arithmetic_prompts, length_reward, perturbed_batch

import grpotrl
from grpotrl.errors import InputError

BETA = 0.1


def _trainer(tiny_llama, grpo_args, **overrides):
    """A GRPO trainer whose policy is perturbed away from its reference, and one prepared batch."""
    # the policy is moved by hand at step 0, which is what I10 exists to catch: off here
    args = grpo_args(beta=BETA, guard_steps=0, check_step0_identity=False, **overrides)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    return trainer, perturbed_batch(trainer)


def _trl_loss(trainer, inputs):
    """TRL 1.16's own _compute_loss, its in-loss k3 included, on the same trainer and batch."""
    return trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)


def _policy_logps(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, ids.size(1) - inputs[
            "prompt_ids"].size(1))[0]  # [B, C]


def test_grpo_config_has_the_kl_fields_with_todays_defaults(tmp_path):
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path))
    assert (args.kl_estimator, args.use_kl_loss, args.use_kl_in_reward, args.kl_in_reward_coef,
            args.kl_in_reward_estimator) == ("k3", True, False, None, None)
    assert grpotrl.GRPOConfig(output_dir=str(tmp_path), beta=0.1, kl_estimator="low_var_kl+").kl_estimator == "k3+"
    with pytest.raises(InputError, match="use_kl_loss and use_kl_in_reward are both off"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), beta=0.1, use_kl_loss=False)
    with pytest.raises(InputError, match="kl_estimator: KL estimator 'k4'"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), kl_estimator="k4")
    gad = grpotrl.GADConfig(output_dir=str(tmp_path))  # GAD's defaults unchanged, from the same fields
    assert (gad.kl_estimator, gad.use_kl_loss, gad.use_kl_in_reward) == ("k3", True, False)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo"])
def test_default_k3_equals_trls_own_loss_value_gradient_and_kl_metric(tiny_llama, grpo_args, loss_type):
    """Control: k3 in the loss (the default) is TRL's loss to rounding where no clamp is active, for
    every loss type's aggregation; the logged ``kl`` is TRL's."""
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    trainer.loss_type = loss_type
    head = trainer.model.get_output_embeddings().weight
    ours = trainer._compute_loss(trainer.model, inputs)
    our_kl = trainer._metrics["train"]["kl"][-1]
    theirs = _trl_loss(trainer, inputs)
    assert trainer.beta == BETA  # TRL's own term was in force in _trl_loss
    assert our_kl > 1e-4  # the policy really differs from the reference
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(our_kl, rel=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(ours, head)[0], torch.autograd.grad(theirs, head)[0],
                               atol=1e-7, rtol=1e-4)


def test_k3_far_from_the_reference_is_clamped_where_trls_is_inf_and_nan(tiny_llama, grpo_args):
    """log pi_ref - log pi = 100 on every token: TRL's k3 is exp(100) - 101 = inf in fp32 (NaN after
    its mask zeroes a padded token: inf * 0), its gradient
    -exp(100) + 1 -> NaN with the ratio's score term (the bug, reintroduced by calling TRL's loss).
    Ours: the log-ratio is clamped to 20, the value to 10 (KL_VALUE_CLAMP), so the term is
    beta * 10 * ratio per token (grpo: the mean over rows of each row's mean): value beta * 10 and, by
    use_bias_correction_kl's score term only, the gradient of beta * 10 * logp, finite."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, loss_type="grpo")
    inputs["ref_per_token_logps"] = _policy_logps(trainer, inputs) + 100.0  # [B, C]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    head = trainer.model.get_output_embeddings().weight
    ours = trainer._compute_loss(trainer.model, inputs)
    assert torch.isfinite(ours), ours
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(ours, params, retain_graph=True,
                                                                     allow_unused=True) if g is not None)
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(10.0)
    trainer._kl_in_loss = False  # the policy loss alone
    alone = trainer._compute_loss(trainer.model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, inputs["completion_ids"].size(1))[0]
    mask = inputs["completion_mask"].float()
    clamped = 10.0 * torch.exp(logp - logp.detach())  # [B, C]: the bound times the ratio (value 1)
    expected = BETA * ((clamped * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()  # grpo, GA 1
    assert (ours - alone).item() == pytest.approx(BETA * 10.0, rel=1e-5)
    torch.testing.assert_close(torch.autograd.grad(ours - alone, head)[0], torch.autograd.grad(expected, head)[0],
                               atol=1e-7, rtol=1e-3)
    theirs = _trl_loss(trainer, inputs)  # TRL 1.16's unclamped k3
    assert not torch.isfinite(theirs), theirs  # inf, or NaN where inf meets a padded token's mask 0
    their_grads = torch.autograd.grad(theirs, params, allow_unused=True)
    assert any(torch.isnan(g).any() for g in their_grads if g is not None)


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3+"])
def test_every_estimator_in_the_grpo_loss_matches_its_formula(tiny_llama, grpo_args, estimator):
    """The added term for the sample-based estimators, value and gradient, against the formula written
    out here on the loss's own logprobs (loss_type dapo: the token sum over num_items_in_batch)."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, kl_estimator=estimator, loss_type="dapo")
    head = trainer.model.get_output_embeddings().weight
    with_kl = trainer._compute_loss(trainer.model, inputs)
    trainer._kl_in_loss = False
    without = trainer._compute_loss(trainer.model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].size(1)
    logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, width)[0]  # [B, C] with grad
    d = logp - inputs["ref_per_token_logps"]  # [B, C]
    kl = {"k1": d * torch.exp(logp - logp.detach()),  # k1 times the ratio (value 1, score term d * d logp)
          "abs": d.abs(),
          "k2": 0.5 * d ** 2,
          "k3+": 0.5 * d ** 2 - (0.5 * d ** 2).detach() + (torch.exp(-d) + d - 1).detach()}[estimator]
    mask = inputs["completion_mask"].float()
    expected = BETA * (kl * mask).sum() / inputs["num_items_in_batch"].clamp(min=1)  # dapo, 1 process, GA 1
    torch.testing.assert_close((with_kl - without).detach(), expected.detach(), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(torch.autograd.grad(with_kl - without, head)[0],
                               torch.autograd.grad(expected, head)[0], atol=1e-7, rtol=1e-3)


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_I10_step0_identity_holds_and_the_kl_is_zero_at_step_0(tiny_llama, grpo_args, estimator):
    """With the KL grpotrl's own, I10 still runs on step 0 (reference logprobs = the loss's), and the
    logged kl of step 0 is 0: policy and reference are one model before the first update."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward,
                                  args=grpo_args(beta=BETA, max_steps=1, kl_estimator=estimator),
                                  train_dataset=arithmetic_prompts())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kl" in h]
    assert logged and abs(logged[0]["kl"]) < 1e-6, logged
    assert [h for h in trainer.state.log_history if "identity/step0_ref_logp_gap/max" in h]


def test_kl_in_reward_is_a_reward_column_of_grpo(tiny_llama, grpo_args):
    """use_kl_in_reward on GRPO: the column kl_penalty, last, is -beta * sum_t k3_t of each response under
    the policy and the reference, recomputed here from plain forwards of both models."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, use_kl_in_reward=True, use_kl_loss=False)
    assert trainer.reward_func_names[-1] == "kl_penalty"
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}], [{"role": "user", "content": "Hi"}]]
    completions = [[11, 12, 13], [14, 2]]
    got = trainer.kl_reward(prompts, None, completions)
    tok = trainer.processing_class
    want = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"] + c])
        with torch.no_grad():
            lp = torch.log_softmax(trainer.model(input_ids=ids).logits[0, -len(c) - 1:-1].float() / 0.7, -1)
            rf = torch.log_softmax(trainer.ref_model(input_ids=ids).logits[0, -len(c) - 1:-1].float() / 0.7, -1)
        t = torch.tensor(c)
        log_r = rf[range(len(c)), t] - lp[range(len(c)), t]
        want.append(-BETA * (torch.exp(log_r) - log_r - 1).sum().item())
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert any(abs(w) > 1e-4 for w in want)
    with pytest.raises(InputError, match="give it a weight too"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                            args=grpo_args(beta=BETA, use_kl_in_reward=True, use_kl_loss=False, reward_weights=[1.0]))


def test_I10_runs_on_the_first_step0_microbatch_that_holds_a_loss_token(tiny_llama, grpo_args, monkeypatch, caplog):
    """I10 ran on the first training microbatch only: where every row of it was masked (truncated under
    mask_truncated_completions, say) it compared nothing, and no later microbatch was checked. It now runs on the
    next microbatch of step 0; where none holds a loss token, a warning says I10 was not checked."""
    from grpotrl.guards import identity

    compared, first = [], []
    check = identity.check_step0_logprobs

    def spy(tokenizer, used, inputs, loss_mask, *args, **kwargs):
        compared.append(int(loss_mask.sum()))
        return check(tokenizer, used, inputs, loss_mask, *args, **kwargs)

    original = grpotrl.GRPOTrainer._check_loss

    def first_masked(self, model, inputs, loss, used, entropies, loss_mask, recomputed):
        if not first:  # the first microbatch holds no loss token
            first.append(True)
            loss_mask = torch.zeros_like(loss_mask)
        return original(self, model, inputs, loss, used, entropies, loss_mask, recomputed)

    monkeypatch.setattr(identity, "check_step0_logprobs", spy)
    monkeypatch.setattr(grpotrl.GRPOTrainer, "_check_loss", first_masked)
    args = grpo_args(beta=BETA, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    trainer.train()
    assert len(compared) == 2 and compared[0] == 0 and compared[1] > 0, compared
    assert [h for h in trainer.state.log_history if "identity/step0_ref_logp_gap/max" in h]

    compared.clear()
    monkeypatch.setattr(grpotrl.GRPOTrainer, "_check_loss",
                        lambda self, model, inputs, loss, used, entropies, loss_mask, recomputed: original(
                            self, model, inputs, loss, used, entropies, torch.zeros_like(loss_mask), recomputed))
    args = grpo_args(beta=BETA, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert compared == [0, 0], compared
    assert [r for r in caplog.records if "I10 was not checked: no microbatch of step 0" in r.getMessage()]


def test_kl_in_reward_without_a_reference_names_a_remedy_the_config_accepts(tiny_llama, grpo_args, monkeypatch):
    """beta 0 with use_kl_in_reward and kl_in_reward_coef 0.01, no PEFT: TRL loads no reference model, so the first
    reward call would find none: refused when the trainer is built, before the model loads. The remedy it names must
    be one GRPOConfig accepts: 'beta > 0 with use_kl_loss: false' alone, with kl_in_reward_coef still set, is refused
    ('beta would be unused'); beta: 0.01 with it dropped is taken. With a LoRA adapter (its disabled adapter is the
    reference) beta 0 is taken."""
    import transformers
    from peft import LoraConfig

    args = grpo_args(beta=0.0, use_kl_in_reward=True, kl_in_reward_coef=0.01, max_steps=1)
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                  lambda *a, **k: (_ for _ in ()).throw(AssertionError("the model loaded before the check")))
        with pytest.raises(InputError) as refused:
            grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                train_dataset=arithmetic_prompts())
    _assert_names_the_missing_reference_and_both_remedies(str(refused.value))
    grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts(),
                        peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(InputError, match="beta would be unused"):  # the remedy without dropping the coefficient
        grpo_args(beta=0.01, use_kl_loss=False, use_kl_in_reward=True, kl_in_reward_coef=0.01)
    remedy = grpo_args(beta=0.01, use_kl_loss=False, use_kl_in_reward=True)
    assert (remedy.beta, remedy.kl_in_reward_coef) == (0.01, None)


def _assert_names_the_missing_reference_and_both_remedies(message: str) -> None:
    """The error for beta 0, use_kl_in_reward, kl_in_reward_coef 0.01 and no PEFT: the settings as given, why there
    is no reference, and both remedies (beta at the reward's coefficient with use_kl_loss off and the coefficient
    dropped; a LoRA adapter, whose disabled adapter is the reference)."""
    assert message.startswith("use_kl_in_reward with beta=0.0 and no PEFT adapter: "), message
    assert "loads a reference model only when beta > 0" in message, message
    assert "with PEFT, the policy with its adapter disabled is the reference" in message, message
    assert re.search(r"set beta: 0\.01 \(with use_kl_loss off, beta is the reward's coefficient\), use_kl_loss: "
                     r"false, and drop kl_in_reward_coef", message), message
    assert "or train a LoRA adapter (peft_config), whose disabled adapter is the reference" in message, message


def test_kl_reward_that_finds_no_reference_after_init_raises_the_preflights_own_error(tiny_llama, grpo_args):
    """beta 0 with use_kl_in_reward and kl_in_reward_coef 0.01 on a LoRA adapter passes the preflight (the disabled
    adapter is the reference). With the adapter merged away after ``__init__`` the reward column ``kl_penalty``
    finds neither a reference model nor an adapter to disable: it raises the preflight's error, word for word
    (``preflight.no_kl_reference``), with every fact and both remedies, never a KL against nothing."""
    from peft import LoraConfig

    args = grpo_args(beta=0.0, use_kl_in_reward=True, kl_in_reward_coef=0.01, max_steps=1)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
    assert trainer.ref_model is None  # beta 0: TRL loaded none; the adapter disabled is the reference
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    # control: computed against it. LoRA's B starts at 0, so the adapter adds exactly 0 and the policy is its
    # reference bit for bit (I10): KL exactly 0 (a B moved by 0.5 gives -2.5e-7 on this tiny model)
    assert trainer.kl_reward([prompt], ["3"], completion_ids=[[28, 2]]) == [0.0]
    trainer.model = trainer.model.merge_and_unload()
    with pytest.raises(InputError) as missing:
        trainer.kl_reward([prompt], ["3"], completion_ids=[[28, 2]])
    _assert_names_the_missing_reference_and_both_remedies(str(missing.value))
    from grpotrl.preflight import no_kl_reference

    assert str(missing.value) == no_kl_reference(0.0, 0.01)


def test_logged_kl_is_trls_token_mean_over_every_process_for_microbatches_of_other_token_counts(
        tiny_llama, grpo_args, monkeypatch):
    """Control (grpotrl's ``kl`` already is TRL 1.16's): TRL logs ``kl`` per microbatch as the token mean over
    every process's loss tokens (``global_masked_mean``: the sum and the count reduced across processes), not
    as a mean of the processes' means. Two processes simulated by the reduce: this one holds rows 0-2, the
    other rows 3-7, of other token counts. The kl logged on rows 0-2 is then grpotrl's = TRL's own = the token
    mean over all 8 rows on one process, and differs from the mean of the two microbatches' means."""
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    B = inputs["completion_ids"].size(0)

    def rows(part):
        return {k: v[part] if torch.is_tensor(v) and v.dim() and v.size(0) == B else v for k, v in inputs.items()}

    def trls_kl(batch):
        _trl_loss(trainer, batch)
        return trainer._metrics["train"]["kl"][-1]

    mine, other = rows(slice(0, 3)), rows(slice(3, B))
    n_mine, n_other = (float((b["completion_mask"] * b.get("tool_mask", 1)).sum()) for b in (mine, other))
    kl_mine, kl_other, kl_all = trls_kl(mine), trls_kl(other), trls_kl(inputs)
    assert n_mine != n_other and abs(kl_mine - kl_other) > 1e-4  # where the two definitions differ
    reduce = trainer.accelerator.reduce

    def two_processes(t, reduction="mean"):
        assert reduction == "sum" and t.shape == (2,)  # TRL's and grpotrl's [sum, count]
        return reduce(t, reduction="sum") + torch.tensor([kl_other * n_other, n_other])

    monkeypatch.setattr(trainer.accelerator, "reduce", two_processes)
    theirs = trls_kl(mine)
    trainer._compute_loss(trainer.model, mine)
    ours = trainer._metrics["train"]["kl"][-1]
    assert ours == pytest.approx(theirs, rel=1e-5) and theirs == pytest.approx(kl_all, rel=1e-5)
    assert abs(ours - (kl_mine + kl_other) / 2) > 1e-5 * abs(ours)  # not the mean of the processes' means
