"""``grpotrl.ops.task_losses``: each task's share of TRL's policy loss, from tensors (I7's task terms).

One microbatch, B = 2 rows of C = 2 tokens, hand-derived for every TRL 1.16 loss_type:

    row 0 (task 0): logp = [-1.0, -2.0], ratio pi/pi_old r = [1.5, 0.5], mask [1, 1], advantage +1
    row 1 (task 1): logp = [-0.5, -3.0], ratio r = [1.1, 2.0],           mask [1, 0], advantage -2

(old logp = logp - log r). Tokens in the microbatch: 3. Gradient accumulation 2.
"""

import math

import pytest
import torch

from grpotrl.ops.loss_types import LOSS_TYPES
from grpotrl.ops.task_losses import PolicyLoss, Reduction, policy_loss_terms, regulariser

LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])  # [B, C]
RATIO = torch.tensor([[1.5, 0.5], [1.1, 2.0]])
OLD = LOGP - RATIO.log()
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])  # [B]
ROWS = {0: torch.tensor([0]), 1: torch.tensor([1])}
GA = 2


def terms(loss_type, **settings):
    reduction = Reduction(loss_type, rows=2, tokens=MASK.sum(), max_completion_length=4, accumulation=GA,
                          num_items_in_batch=torch.tensor(6.0), num_processes=1, steps_per_generation=4)
    out = policy_loss_terms({k: LOGP[r] for k, r in ROWS.items()}, ROWS, OLD, ADV, MASK,
                            PolicyLoss(loss_type, **settings), reduction)
    return [float(out[0]), float(out[1])]


# clipped ratio, eps 0.2: per token -min(r A, clip(r, 0.8, 1.2) A)
#   row 0 (A = +1): -min(1.5, 1.2) = -1.2; -min(0.5, 0.8) = -0.5       -> sum -1.7, mean -0.85
#   row 1 (A = -2): -min(-2.2, -2.2) = +2.2; token 2 masked              -> sum  2.2, mean  2.2
@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", [-0.85 / 2 / GA, 2.2 / 2 / GA]),  # row means over B = 2 rows
    ("bnpo", [-1.7 / 3 / GA, 2.2 / 3 / GA]),  # token sums over the microbatch's 3 tokens
    ("dr_grpo", [-1.7 / (2 * 4) / GA, 2.2 / (2 * 4) / GA]),  # over B * max_completion_length
    ("luspo", [-1.7 / 2 / GA, 2.2 / 2 / GA]),  # row sums over B
    ("dapo", [-1.7 / 3, 2.2 / 3]),  # over num_items 6 / 1 process * GA 2 / steps_per_generation 4 = 3
])
def test_I7_clipped_ratio_loss_types_hand_derived(loss_type, expected):
    assert terms(loss_type) == pytest.approx(expected, rel=1e-6)


def test_I7_cispo_hand_derived():
    # -min(r, eps_high = 1.2) A logp (the weight detached): row 0: -(1.2 * 1 * -1) - (0.5 * 1 * -2) = 2.2;
    # row 1: -(1.1 * -2 * -0.5) = -1.1; reduced as dapo (over 3)
    assert terms("cispo", epsilon_high=1.2) == pytest.approx([2.2 / 3, -1.1 / 3], rel=1e-6)


def test_I7_sapo_hand_derived():
    # -sigmoid(t (r - 1)) 4 / t * A, t = 1.0 for A > 0, 1.05 otherwise; reduced as grpo
    # row 0: -4 (sigmoid(0.5) + sigmoid(-0.5)) = -4 -> mean -2
    # row 1: +2 * 4 / 1.05 * sigmoid(1.05 * 0.1) (token 2 masked) -> mean itself
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row1 = 2 * 4 / 1.05 * sig(0.105)
    assert terms("sapo") == pytest.approx([-2.0 / 2 / GA, row1 / 2 / GA], rel=1e-6)


def test_I7_vespo_hand_derived():
    # phi = e^lam w^k e^(-lam w), w = the sequence's ratio over its masked tokens; -phi A logp; reduced as dapo
    # row 0 (A >= 0: k 2, lam 3): w = 1.5 * 0.5 = 0.75, phi = e^3 0.75^2 e^-2.25; -phi (-1 - 2) = 3 phi
    # row 1 (A < 0: k 3, lam 2): w = 1.1, phi = e^2 1.1^3 e^-2.2; -phi (-2)(-0.5) = -phi
    phi0 = math.exp(3) * 0.75 ** 2 * math.exp(-2.25)
    phi1 = math.exp(2) * 1.1 ** 3 * math.exp(-2.2)
    assert terms("vespo") == pytest.approx([3 * phi0 / 3, -phi1 / 3], rel=1e-5)


def test_I7_sequence_level_ratio_and_delta_hand_derived():
    # sequence level: one ratio per row, exp(mean log r over its tokens)
    # row 0: sqrt(1.5 * 0.5) = 0.8660 (inside the clip range): -0.8660 on each token, mean -0.8660
    # row 1: 1.1: +2.2
    assert terms("grpo", importance_sampling_level="sequence") == pytest.approx(
        [-math.sqrt(0.75) / 2 / GA, 2.2 / 2 / GA], rel=1e-6)
    # delta = 1.05 caps the unclipped ratio: row 1 -min(1.05 * -2, 1.1 * -2) = 2.2 (unchanged);
    # row 0: -min(min(1.5, 1.05), 1.2) = -1.05, -0.5 -> mean -0.775
    assert terms("grpo", delta=1.05) == pytest.approx([-0.775 / 2 / GA, 2.2 / 2 / GA], rel=1e-6)


def test_I7_absent_task_term_is_zero_and_terms_split_any_way():
    # a task with no rows gets 0; the two rows as one task give the sum of their terms
    empty = torch.zeros(0, dtype=torch.long)
    reduction = Reduction("grpo", rows=2, tokens=MASK.sum(), max_completion_length=4, accumulation=GA)
    out = policy_loss_terms({0: LOGP, 1: LOGP[empty]}, {0: torch.tensor([0, 1]), 1: empty}, OLD, ADV, MASK,
                            PolicyLoss("grpo"), reduction)
    assert float(out[1]) == 0.0
    assert float(out[0]) == pytest.approx((-0.85 + 2.2) / 2 / GA, rel=1e-6)


def test_I7_regulariser_hand_derived():
    # beta * k3 KL reduced as the policy loss, minus c * mean entropy over the mask / GA, plus aux / GA
    # ref = logp everywhere except row 0 token 0, ref - logp = log 2: k3 = 2 - log 2 - 1 = 0.30685
    # grpo: row 0 mean 0.30685 / 2, over B = 2 and GA: 0.30685 / 2 / 2 / 2; times beta 0.1
    # entropy: (1 + 2 + 3) / 3 tokens / GA = 1.0; times c 0.5 -> -0.5. aux 0.4 * 0.5 / GA = 0.1
    ref = LOGP.clone()
    ref[0, 0] += math.log(2)
    entropies = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    reduction = Reduction("grpo", rows=2, tokens=MASK.sum(), max_completion_length=4, accumulation=GA)
    got = regulariser(LOGP, OLD, ref, entropies, MASK, PolicyLoss("grpo"), reduction, beta=0.1, entropy_coef=0.5,
                      aux_loss=torch.tensor(0.4), aux_coef=0.5)
    kl = 2 - math.log(2) - 1
    assert float(got) == pytest.approx(0.1 * kl / 2 / 2 / GA - 0.5 + 0.1, rel=1e-6)


def test_unknown_loss_type_is_refused():
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        PolicyLoss("ppo")


class _TRLState:
    """The fields ``trl.GRPOTrainer._compute_loss`` reads, as the trainer would hold them (one process,
    training mode): TRL's own loss code runs on them below, unchanged."""

    def __init__(self, loss_type, entropies, level="token", **args):
        from collections import defaultdict
        from types import SimpleNamespace

        import trl

        self.loss_type, self.importance_sampling_level, self.beta = loss_type, level, 0.1
        self.epsilon_low, self.epsilon_high = 0.2, args.pop("epsilon_high", 0.2)
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = self.aux_loss_enabled = False
        self._entropy_bonus_enabled, self.use_adaptive_entropy, self.entropy_coef = True, False, 0.5
        self.current_gradient_accumulation_steps, self.max_completion_length = GA, 4
        self.model, self._metrics = SimpleNamespace(training=True), {"train": defaultdict(list)}
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                                    sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                    vespo_lambda_neg=2.0, steps_per_generation=4, **args)
        self.accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                           gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
        self.get_gamma_weights = trl.GRPOTrainer.get_gamma_weights
        self._forward = (LOGP, entropies, None)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._forward


@pytest.mark.parametrize("loss_type,level", [(t, "token") for t in LOSS_TYPES]  # every entry of the table
                         + [("grpo", "sequence"), ("luspo", "sequence")])
def test_I7_terms_and_regulariser_add_up_to_trls_own_loss(loss_type, level):
    """The restatement against TRL 1.16's ``_compute_loss`` itself, every loss type: KL (beta 0.1) and
    entropy bonus (c 0.5) on; sum_k L_k + regulariser is TRL's loss (what the run-time guard checks)."""
    import trl

    entropies = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    ref = LOGP + torch.tensor([[0.3, -0.2], [0.1, 0.4]])
    state = _TRLState(loss_type, entropies, level, **({"epsilon_high": 1.2} if loss_type == "cispo" else {}))
    inputs = {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1),
              "completion_ids": torch.zeros(2, 2, dtype=torch.long), "completion_mask": MASK, "advantages": ADV,
              "old_per_token_logps": OLD, "ref_per_token_logps": ref, "num_items_in_batch": torch.tensor(6.0)}
    trl_loss = float(trl.GRPOTrainer._compute_loss(state, None, inputs))
    settings = PolicyLoss(loss_type, importance_sampling_level=level, epsilon_high=state.epsilon_high)
    reduction = Reduction(loss_type, rows=2, tokens=MASK.sum(), max_completion_length=4, accumulation=GA,
                          num_items_in_batch=torch.tensor(6.0), num_processes=1, steps_per_generation=4)
    task = policy_loss_terms({k: LOGP[r] for k, r in ROWS.items()}, ROWS, OLD, ADV, MASK, settings, reduction)
    reg = regulariser(LOGP, OLD, ref, entropies, MASK, settings, reduction, beta=0.1, entropy_coef=0.5)
    assert float(sum(task.values()) + reg) == pytest.approx(trl_loss, rel=1e-6, abs=1e-7)
    assert abs(float(reg)) > 0.1 and all(abs(float(v)) > 1e-3 for v in task.values())  # every part counts


def test_trl_fields_multitask_reads_for_the_restated_loss():
    """``MultiTaskGRPOTrainer._trl_loss_fields`` reads these TRL attributes (set in ``__init__``), and
    records TRL's top-entropy mask from the ``get_high_entropy_mask`` call inside ``_compute_loss``."""
    import inspect

    import trl

    init = inspect.getsource(trl.GRPOTrainer.__init__)
    for needle in ("self.loss_type = ", "self.beta = ", "self.epsilon_low = ", "self.epsilon_high = ",
                   "self.importance_sampling_level = ", "self.max_completion_length = ",
                   "self.off_policy_mask_threshold = ", "self.use_vllm = ",
                   "self.vllm_importance_sampling_correction = ",
                   "self.aux_loss_enabled = ", "self.router_aux_loss_coef = "):
        assert needle in init, f"trl.GRPOTrainer.__init__ no longer sets {needle!r}"
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert "entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)" in loss


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_I7_sampler_ratio_multiplies_the_loss_or_goes_into_the_weight_as_trl_does(loss_type):
    """vLLM's importance-sampling correction on: TRL multiplies each token's policy loss by the sampler's
    ratio, except for a loss type that ``folds_sampler_ratio`` into its sequence weight (VESPO's gamma
    weight). The restatement with the same ratio is TRL's loss, every loss type."""
    import trl

    entropies = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    ref = LOGP + torch.tensor([[0.3, -0.2], [0.1, 0.4]])
    level = "sequence" if loss_type == "luspo" else "token"
    state = _TRLState(loss_type, entropies, level, **({"epsilon_high": 1.2} if loss_type == "cispo" else {}))
    state.use_vllm = state.vllm_importance_sampling_correction = True
    ratio = torch.tensor([[0.9, 1.3], [1.1, 1.0]])  # [B, C], the sampler's truncated ratio
    inputs = {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1),
              "completion_ids": torch.zeros(2, 2, dtype=torch.long), "completion_mask": MASK, "advantages": ADV,
              "old_per_token_logps": OLD, "ref_per_token_logps": ref, "num_items_in_batch": torch.tensor(6.0),
              "importance_sampling_ratio": ratio}
    trl_loss = float(trl.GRPOTrainer._compute_loss(state, None, inputs))
    settings = PolicyLoss(loss_type, importance_sampling_level=level, epsilon_high=state.epsilon_high)
    reduction = Reduction(loss_type, rows=2, tokens=MASK.sum(), max_completion_length=4, accumulation=GA,
                          num_items_in_batch=torch.tensor(6.0), num_processes=1, steps_per_generation=4)
    task = policy_loss_terms({k: LOGP[r] for k, r in ROWS.items()}, ROWS, OLD, ADV, MASK, settings, reduction,
                             importance_sampling_ratio=ratio)
    reg = regulariser(LOGP, OLD, ref, entropies, MASK, settings, reduction, beta=0.1, entropy_coef=0.5)
    assert float(sum(task.values()) + reg) == pytest.approx(trl_loss, rel=1e-6, abs=1e-7)
    without = policy_loss_terms({k: LOGP[r] for k, r in ROWS.items()}, ROWS, OLD, ADV, MASK, settings, reduction)
    assert float(sum(without.values())) != pytest.approx(float(sum(task.values())), rel=1e-3)  # the ratio counts
