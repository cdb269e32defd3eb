"""``generation.growing_cache``: a KV cache layer that writes each decoding step in place, and holds what
transformers' ``DynamicLayer`` holds at every step."""

import contextlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LogitsProcessor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from grpotrl.generation import growing_cache
from grpotrl.generation.growing_cache import ROOM, GrowingLayer, grow_in_place
from grpotrl.trainers import _intercept


def _kv(rows: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, s, 4, generator=g), torch.randn(rows, 3, s, 4, generator=g)  # [B, Hk, s, D]


def test_a_growing_layer_holds_what_dynamic_layer_holds_and_copies_once_per_room():
    """A prefill of 5 positions, then 70 steps of one; a row selection at step 40 and a crop of 3 at step 55
    (as the finished-row rollout and assisted decoding do): after every update both layers return the same
    keys and values; the buffer moves only when the room runs out or at the selection (gathered into a new
    buffer with room); the crop keeps it."""
    plain, growing = DynamicLayer(), GrowingLayer()
    moves, last = 0, None
    for step in range(71):
        k, v = _kv(4 if step < 40 else 2, 5 if step == 0 else 1, step)
        if step == 40:
            for layer in (plain, growing):
                layer.batch_select_indices(torch.tensor([1, 3]))
        if step == 55:
            for layer in (plain, growing):
                layer.crop(-3)
        pk, pv = plain.update(k, v)
        gk, gv = growing.update(k, v)
        assert torch.equal(gk, pk) and torch.equal(gv, pv) and growing.get_seq_length() == plain.get_seq_length()
        moves += growing._key_room.data_ptr() != last
        last = growing._key_room.data_ptr()
    # the prefill; steps 1-32 fill its room; 33 moves; 40's selection gathers 44 positions into 76; 72 at the end
    assert moves == 3, moves
    assert gk.stride(2) == 4 and gk.shape[2] == 5 + 70 - 3 and growing._key_room.shape[2] >= gk.shape[2] + 1
    growing.reset()
    assert growing._key_room is None and growing.get_seq_length() == 0


def test_grow_in_place_takes_only_empty_plain_layers():
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), DynamicLayer()]
    cache.layers[2].update(*_kv(1, 2, 0))
    grow_in_place(cache)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, DynamicSlidingWindowLayer, DynamicLayer]


class StopAt(LogitsProcessor):
    """Row i samples eos at generation step ``stops[i]`` and never before."""

    def __init__(self, stops: list[int], prompt_width: int, eos: int):
        self.stops, self.prompt_width, self.eos = torch.tensor(stops), prompt_width, eos

    def __call__(self, input_ids, scores):
        t = input_ids.size(1) - self.prompt_width
        scores = scores.clone()
        scores[self.stops > t, self.eos] = -float("inf")
        scores[self.stops == t] = -float("inf")
        scores[self.stops == t, self.eos] = 0.0
        return scores


def test_the_finished_row_rollout_grows_its_cache_in_place(tiny_llama, monkeypatch):
    """Under ``skip_finished_rows`` a generate call's cache layers are growing layers: 3 rows (two of one prompt)
    stopping at steps 4, 9 and 9 copy each layer's keys and values three times in 10 decoding steps, not at every
    step (the prefill's buffer, the prefill copied to the repeated row, the selection when row 0 stops; each
    selection gathered straight into a buffer with room); the sequences are those of the plain call."""
    tok = AutoTokenizer.from_pretrained(tiny_llama, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    batch = tok(["1 + 1 =", "What is two plus three, in words?", "1 + 1 ="], return_tensors="pt", padding=True)
    P = batch["input_ids"].size(1)
    rooms = []  # (how, cached positions) of each buffer a layer's keys or values moved into
    room, selected = growing_cache._room, growing_cache._selected
    monkeypatch.setattr(growing_cache, "_room", lambda *a: rooms.append(("room", a[2])) or room(*a))
    monkeypatch.setattr(growing_cache, "_selected", lambda *a: rooms.append(("selected", a[2])) or selected(*a))
    monkeypatch.setattr(growing_cache, "ROOM", 6)
    out = {}
    for drop in (False, True):
        torch.manual_seed(0)
        with torch.no_grad(), (_intercept.skip_finished_rows(model) if drop else contextlib.nullcontext([])):
            out[drop] = model.generate(**batch, max_new_tokens=12, do_sample=True, pad_token_id=tok.pad_token_id,
                                       eos_token_id=tok.eos_token_id,
                                       logits_processor=[StopAt([4, 9, 9], P, tok.eos_token_id)])
    assert torch.equal(out[True], out[False]) and out[True].size(1) == P + 10
    # cached positions at each copy: 0 (the prefill of the 2 distinct rows); P (the prefill's cache copied to the
    # repeated row); P + 4 (the first forward after row 0 sampled eos at step 4: the selection), whose room of 6
    # outlasts the last step
    per_layer = [("room", 0), ("selected", P), ("selected", P + 4)]
    assert rooms == [n for n in per_layer for _ in range(2 * model.config.num_hidden_layers)], rooms
