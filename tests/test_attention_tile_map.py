"""The dense-mask tile map of the Triton attention kernels (kernels/attention.py).

A bool or float mask is classified once, for every tile shape the kernels use (live: some
element may attend; dense: the mask must be read); each key loop runs from its first to its
last live tile and reads no mask on tiles that are not dense. The map is cached with the mask
tensor, so the layers of a model that share a mask, and the backward, build it once.

Through the interpreter (tests/conftest.py) the kernels' tiles span one or two cells of
MAP_CELL, so the masks here are drawn cell by cell: wholly masked, wholly allowed, or mixed.
"""

import pytest
import torch

import fasttrans
from fasttrans import reference

from helpers import TRITON_DEVICES, skip_module_without_triton

skip_module_without_triton("attention")

from fasttrans.kernels import attention as K  # noqa: E402  (after conftest chose the interpreter)

DEVICES = TRITON_DEVICES
CELL = K.MAP_CELL.value if hasattr(K.MAP_CELL, "value") else K.MAP_CELL


def cell_mask(shape, device, seed=0, kind="bool", cell=CELL):
    """A mask whose cell x cell cells (MAP_CELL by default) are each empty, full or mixed, at
    random: bool (True = may attend) or float (0 / -inf, mixed cells with finite values too)."""
    g = torch.Generator().manual_seed(seed)
    *lead, Lq, Lk = shape
    cm, cn = -(-Lq // cell), -(-Lk // cell)
    cls = torch.randint(0, 3, (*lead, cm, cn), generator=g)  # 0 empty, 1 full, 2 mixed
    cls = cls.repeat_interleave(cell, -2).repeat_interleave(cell, -1)[..., :Lq, :Lk]
    mixed = torch.rand(shape, generator=g) < 0.6
    allowed = (cls == 1) | ((cls == 2) & mixed)
    if kind == "bool":
        return allowed.to(device)
    values = torch.where(allowed, 0.0, float("-inf"))
    values = torch.where((cls == 2) & mixed, torch.randn(shape, generator=g), values)  # finite, not 0
    return values.to(device)


def expected_map(mask, shape, tile):
    """The codes of (tile) tiles by torch: per (b, h, tile row, tile column), LIVE | DENSE."""
    B, H, Lq, Lk = shape
    m = mask.expand(shape)
    if m.dtype == torch.bool:
        live, dense = m, ~m
    else:
        live, dense = torch.ones_like(m, dtype=torch.bool), m != 0
    pad_m, pad_n = -(-Lq // K.MAP_TILE.value) * K.MAP_TILE.value, -(-Lk // K.MAP_TILE.value) * K.MAP_TILE.value
    tm, tn = tile

    def pooled(x):
        x = torch.nn.functional.pad(x.to(torch.int32), (0, pad_n - Lk, 0, pad_m - Lq))
        return x.view(B, H, pad_m // tm, tm, pad_n // tn, tn).amax((3, 5))

    return (pooled(live) * K.MAP_LIVE.value + pooled(dense) * K.MAP_DENSE.value).to(torch.int8)


def _run(q, k, v, kw, fn):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = dict(kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kw["attn_mask"] = mask = mask.detach().clone().requires_grad_()
        leaves.append(mask)
    out = fn(*leaves[:3], **kw)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out) + torch.arange(out.shape[-1], device=out.device))
    return [out, *grads]


def _triton(q, k, v, **kw):
    with fasttrans.use_backend("triton"):
        return fasttrans.attention(q, k, v, **kw)


def _check(q, k, v, kw):
    got = _run(q, k, v, kw, _triton)
    want = _run(q.double(), k.double(), v.double(),
                {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()},
                reference.attention)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), got, want):
        torch.testing.assert_close(a, b.to(a.dtype), atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["full", "batch1", "heads1", "rows1", "2d", "strided"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_map_classifies_every_tile_of_every_shape(kind, layout, device):
    B, H, Lq, Lk = 2, 3, 37, 150
    shapes = {"full": (B, H, Lq, Lk), "batch1": (1, H, Lq, Lk), "heads1": (B, 1, Lq, Lk), "rows1": (B, 1, 1, Lk),
              "2d": (Lq, Lk), "strided": (B, H, Lq, 2 * Lk)}
    mask = cell_mask(shapes[layout], device, kind=kind)
    if layout == "strided":
        mask = mask[..., ::2]
    for tile in [(16 << i, 16 << j) for i in range(4) for j in range(4)]:
        got = K.attention_tile_map(mask, (B, H, Lq, Lk), tile)
        want = expected_map(mask, (B, H, Lq, Lk), tile)
        # broadcast dims hold one entry
        assert got.shape[0] == (1 if layout in ("batch1", "2d") else B)
        assert got.shape[1] == (1 if layout in ("heads1", "rows1", "2d") else H)
        if layout == "rows1":  # one row of tiles for every query tile, padding rows included
            assert got.shape[2] == 1
            want = want[:, :, :1]
        torch.testing.assert_close(got.expand(want.shape).cpu(), want.cpu(), atol=0, rtol=0,
                                   msg=lambda m: f"tile {tile}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["full", "heads1", "rows1", "2d", "strided"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_lists_hold_each_rows_full_and_partial_tiles_in_order(kind, layout, device):
    """The tile lists: per row of list tiles, the prefix counts of its full (live, not dense)
    and partial (live and dense) tiles, and their column indices in increasing order."""
    B, H, Lq, Lk = 2, 3, 70, 300
    shapes = {"full": (B, H, Lq, Lk), "heads1": (B, 1, Lq, Lk), "rows1": (B, 1, 1, Lk), "2d": (Lq, Lk),
              "strided": (B, H, Lq, 2 * Lk)}
    mask = cell_mask(shapes[layout], device, seed=13, kind=kind, cell=32)
    if layout == "strided":
        mask = mask[..., ::2]
    list_tile, full_count, part_count, full_index, part_index = K.attention_tile_lists(mask, (B, H, Lq, Lk))
    codes = expected_map(mask, (B, H, Lq, Lk), (list_tile, list_tile))
    if layout == "rows1":
        codes = codes[:, :, :1]
    codes = codes[:full_count.shape[0], :full_count.shape[1]].long().cpu()
    live, dense = codes & K.MAP_LIVE.value != 0, codes & K.MAP_DENSE.value != 0
    assert (live & ~dense).any() and (live & dense).any() and (~live).any(), "a mask with every kind of tile"
    for cls, count, index in ((live & ~dense, full_count, full_index), (live & dense, part_count, part_index)):
        want_count = torch.nn.functional.pad(cls.long().cumsum(-1), (1, 0))
        torch.testing.assert_close(count.cpu().long(), want_count, atol=0, rtol=0)
        for b, h, r in zip(*[i.flatten() for i in torch.meshgrid(*map(torch.arange, cls.shape[:3]), indexing="ij")]):
            want = cls[b, h, r].nonzero().flatten()
            got = index[b, h, r].cpu().long()
            assert got[:len(want)].tolist() == want.tolist() and (got[len(want):] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_map_launches_are_bound_once_per_geometry(device, monkeypatch):
    """A new mask tensor of a geometry seen before (a model's padding mask, every forward)
    launches the map's kernels as first bound, with the codes and lists of its own values;
    a mask at another alignment binds its own."""
    monkeypatch.setattr(K, "_TILE_MAPS", {})
    monkeypatch.setattr(K, "_MAP_LAUNCHES", {})
    B, H, Lq, Lk = 2, 3, 37, 150
    shape = (B, H, Lq, Lk)
    bound = []
    for seed, offset in ((0, 0), (1, 0), (2, 1)):
        storage = cell_mask((B, 1, 1, Lk + 1), device, seed=seed)
        mask = storage[..., offset:offset + Lk]
        got = K.attention_tile_map(mask, shape)
        want = expected_map(mask, shape, (16, 16))[:, :, :1]
        torch.testing.assert_close(got.expand(want.shape).cpu(), want.cpu(), atol=0, rtol=0)
        list_tile, full_count, _, _, _ = K.attention_tile_lists(mask, shape)
        codes = expected_map(mask, shape, (list_tile, list_tile))[:, :1, :1].long().cpu()
        full = (codes & K.MAP_LIVE.value != 0) & (codes & K.MAP_DENSE.value == 0)
        assert full_count.cpu().long().tolist() == torch.nn.functional.pad(full.long().cumsum(-1), (1, 0)).tolist()
        bound.append(dict(K._MAP_LAUNCHES))
    # the first mask bound the map and lists launches, the second none (the same launch
    # objects), the third (its data one byte off: another alignment) both again (the lists
    # kernel packs a bool mask's bits)
    assert sorted(key[0] for key in bound[0]) == ["lists", "map"]
    assert bound[1] == bound[0] and all(bound[1][key] is launch for key, launch in bound[0].items())
    assert sorted(key[0] for key in bound[2]) == ["lists", "lists", "map", "map"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["full", "rows1", "heads", "strided"])
def test_bool_mask_bits_follow_their_layout(layout, device):
    """The tile lists kernel packs a bool mask's bits after each tile row's lists: query row
    i's int32 word w holds at bit t key 64 (w // 4) + 8 (t // 2) + 2 (w % 4) + t % 2; keys
    past Lk, rows past Lq and the upper 16 bits are 0; a mask broadcast over queries gives
    every row its one row."""
    B, H, Lq, Lk = 2, 3, 45, 150
    if layout == "strided":  # rows Lk + 7 apart, starting 3 keys in
        mask = cell_mask((B, 1, Lq, Lk + 7), device, seed=5)[..., 3:3 + Lk]
    else:
        mask = cell_mask({"full": (B, 1, Lq, Lk), "rows1": (B, 1, 1, Lk), "heads": (1, H, Lq, Lk)}[layout],
                         device, seed=5)
    _, lists, geometry = K._tile_map_of(mask, (B, H, Lq, Lk))
    Bm, Hm = geometry[2][:2]
    list_tile, rows, tiles, _ = geometry[4]
    width, words = -(-(4 * tiles + 2) // 16) * 16, -(-(tiles * list_tile) // 64) * 4
    got = lists[..., width:].reshape(Bm, Hm, rows * list_tile, words).cpu().long()
    m = mask.cpu().expand(B, H, mask.shape[2], Lk)[:Bm, :Hm]
    if mask.shape[2] == 1:
        m = m.expand(Bm, Hm, rows * list_tile, Lk)
    m = torch.nn.functional.pad(m, (0, words * 16 - Lk, 0, rows * list_tile - m.shape[2]))
    w, t = torch.arange(words)[:, None], torch.arange(16)[None, :]
    keys = 64 * (w // 4) + 8 * (t // 2) + 2 * (w % 4) + t % 2  # (words, 16)
    want = (m[..., keys].long() << t).sum(-1)
    assert got.shape == want.shape and torch.equal(got, want)
    assert int(want.count_nonzero()) > 0


def block_mask(shape, device, block, seed=0, kind="bool"):
    """cell_mask drawn by blocks of the tile lists' tile, so that whole list tiles are empty,
    full and mixed (the loops over listed full and partial tiles all run)."""
    return cell_mask(shape, device, seed=seed, kind=kind, cell=block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bool", "float", "bool+key_lengths+causal", "float+causal+key_lengths",
                                  "bool+gqa", "rows1+causal_br", "bool+dropout", "bool+softcap",
                                  "float+causal+softcap"])
def test_masks_with_empty_full_and_partial_list_tiles_match_reference(kind, device):
    """Whole list tiles of each kind, with the key lengths and causal masks that end the
    listed loops mid-row: outputs and every gradient, the float mask's included; soft-capped
    scores through the same loops."""
    block = K._list_tile()
    B, H, Lq, Lk, D = 1, 2, 3 * block + 5, 5 * block - 3, 16
    Hkv = 1 if "gqa" in kind else H
    torch.manual_seed(14)
    q = torch.randn(B, H, Lq, D, device=device)
    k, v = (torch.randn(B, Hkv, Lk, D, device=device) for _ in range(2))
    shape = (B, 1, 1, Lk) if "rows1" in kind else (B, 1, Lq, Lk) if "bool" in kind else (H, Lq, Lk)
    kw = {"attn_mask": block_mask(shape, device, block, seed=15, kind="float" if "float" in kind else "bool")}
    if "key_lengths" in kind:
        kw["key_lengths"] = torch.tensor([Lk - block - 7], device=device)
    if "causal" in kind:
        kw["is_causal"] = True
    if "causal_br" in kind:
        kw["causal_offset"] = Lk - Lq
    if "softcap" in kind:
        q, kw["softcap"] = q * 4, 1.5
    if "dropout" in kind:
        p = 0.25
        torch.manual_seed(16)
        got = _triton(q, k, v, dropout_p=p, **kw)
        torch.manual_seed(16)
        keep = fasttrans.functional.attention_dropout_mask(q, k, p)
        want = reference.attention(q.double(), k.double(), v.double(), dropout_p=p, dropout_mask=keep, **kw)
        torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)
        return
    _check(q, k, v, kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("layout", ["full", "rows1"])
def test_bool_mask_bits_at_the_gpus_tile_widths(layout, block_n, device, monkeypatch):
    """A bool mask's listed partial tiles read its bits (kernels/attention.py, packed by
    _attention_tile_lists_kernel): at the GPU's list tile of 128 and key tiles of 64 (one word
    per row and thread) and 128 (two), where the interpreter's own 16-key tiles shift their
    64-key group's word."""
    import triton

    tiles = triton.Config({"BLOCK_M": 32, "BLOCK_N": block_n}, num_warps=4, num_stages=1)
    monkeypatch.setattr(K, "LIST_TILE_INTERPRETER", 128)
    monkeypatch.setattr(K, "INTERPRETER_CONFIGS", dict(K.INTERPRETER_CONFIGS, fwd=tiles, dq=tiles))
    B, H, Lq, Lk, D = 1, 2, 128 + 5 + block_n // 64, 3 * 128 - 3, 16  # shapes no other test's sites share
    torch.manual_seed(17)
    q = torch.randn(B, H, Lq, D, device=device)
    k, v = (torch.randn(B, H, Lk, D, device=device) for _ in range(2))
    shape = (B, 1, 1, Lk) if layout == "rows1" else (B, 1, Lq, Lk)
    # seed 20 draws the list tiles (mixed, full, empty) in the first row of tiles and (full, empty,
    # mixed) in the second: a mixed tile in each, the key columns' first and last
    _check(q, k, v, {"attn_mask": block_mask(shape, device, 128, seed=20, kind="bool")})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bool", "float", "bool+key_lengths+causal", "float+causal", "bool+gqa",
                                  "rows1+causal_br"])
def test_masks_with_empty_full_and_mixed_tiles_match_reference(kind, device):
    B, H, Lq, Lk, D = 2, 2, 70, 90, 16
    Hkv = 1 if "gqa" in kind else H
    torch.manual_seed(1)
    q = torch.randn(B, H, Lq, D, device=device)
    k, v = (torch.randn(B, Hkv, Lk, D, device=device) for _ in range(2))
    shape = (B, 1, 1, Lk) if "rows1" in kind else (B, 1, Lq, Lk) if "bool" in kind else (H, Lq, Lk)
    kw = {"attn_mask": cell_mask(shape, device, seed=2, kind="float" if "float" in kind else "bool")}
    if "key_lengths" in kind:
        kw["key_lengths"] = torch.tensor([Lk - 19, Lk], device=device)
    if "causal" in kind:
        kw["is_causal"] = True
    if "causal_br" in kind:
        kw["causal_offset"] = Lk - Lq
    _check(q, k, v, kw)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_with_a_tile_map_matches_reference(device):
    B, H, Lq, Lk, D, p = 1, 1, 32, 48, 16, 0.3
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, device=device) for L in (Lq, Lk, Lk))
    mask = cell_mask((B, H, Lq, Lk), device, seed=4)
    torch.manual_seed(7)
    got = _triton(q, k, v, attn_mask=mask, dropout_p=p)
    torch.manual_seed(7)
    keep = fasttrans.functional.attention_dropout_mask(q, k, p)
    want = reference.attention(q.double(), k.double(), v.double(), attn_mask=mask, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_follow_the_map(device, monkeypatch):
    """Tiles outside the live span are skipped; "live, not dense" ones read no mask."""
    B, H, Lq, Lk, D = 1, 2, 32, 48, 16
    torch.manual_seed(5)
    q, k, v = (torch.randn(B, H, L, D, device=device) for L in (Lq, Lk, Lk))
    mask = torch.rand(B, H, Lq, Lk, device=device) > 0.5
    build = K._build_tile_map

    def forced(code):
        def fake(*args):
            return torch.full_like(build(*args), code)
        return fake

    monkeypatch.setattr(K, "_TILE_MAPS", {})
    monkeypatch.setattr(K, "_build_tile_map", forced(K.MAP_LIVE.value))  # every tile full: the mask unread
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _triton(*leaves, attn_mask=mask.clone())
    torch.testing.assert_close(out, reference.attention(q, k, v))
    grads = torch.autograd.grad(out.sum(), leaves)
    want = torch.autograd.grad(reference.attention(*leaves).sum(), leaves)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)
    monkeypatch.setattr(K, "_build_tile_map", forced(0))  # nothing live: nothing attended
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _triton(*leaves, attn_mask=mask.clone())
    assert (out == 0).all()
    assert all((g == 0).all() for g in torch.autograd.grad(out.sum(), leaves))
    monkeypatch.setattr(K, "_build_tile_map", build)
    torch.testing.assert_close(_triton(q, k, v, attn_mask=mask.clone()), reference.attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_an_inf_value_in_a_tile_the_mask_forbids_is_never_read(where, device):
    """Key tiles a bool mask forbids entirely are skipped outright (their keys and values never
    loaded) by the forward, where a mixed tile weighs a masked key's inf value by 0 (NaN, as
    the reference's dense product)."""
    Lq, Lk, D = CELL, 4 * CELL, 8
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 1, L, D, device=device) for L in (Lq, Lk, Lk))
    mask = torch.ones(1, 1, Lq, Lk, dtype=torch.bool, device=device)
    start = {"first": 0, "middle": CELL, "last": 3 * CELL}[where]
    cols = slice(start, start + CELL)
    mask[..., cols] = False  # a whole key tile of the interpreter's, at one end
    v[0, 0, cols.start + 1, 0] = float("inf")
    assert torch.isfinite(_triton(q, k, v, attn_mask=mask)).all()
    mask[0, 0, 0, cols.start + 5] = True  # now mixed: the masked inf key enters as 0 * inf
    assert _triton(q, k, v, attn_mask=mask)[0, 0, :, 0].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_map_is_built_once_per_mask_and_follows_its_changes(device, monkeypatch):
    B, H, Lq, Lk, D = 2, 2, 33, 40, 8
    torch.manual_seed(8)
    q, k, v = (torch.randn(B, H, L, D, device=device, requires_grad=True) for L in (Lq, Lk, Lk))
    builds = []
    build = K._build_tile_map
    monkeypatch.setattr(K, "_TILE_MAPS", {})
    monkeypatch.setattr(K, "_build_tile_map", lambda *a: builds.append(a) or build(*a))
    mask = cell_mask((B, 1, Lq, Lk), device, seed=9)
    x = q
    for _ in range(3):  # three layers sharing one mask, forward and backward
        x = _triton(x, k, v, attn_mask=mask)
    x.sum().backward()
    assert len(builds) == 1, f"{len(builds)} builds for one mask"
    # changed in place: the next call sees the new mask
    mask[:, :, :, : Lk // 2] = ~mask[:, :, :, : Lk // 2]
    with torch.no_grad():
        out = _triton(q, k, v, attn_mask=mask)
    assert len(builds) == 2
    torch.testing.assert_close(out, reference.attention(q, k, v, attn_mask=mask))
    # a new mask object, and one broadcast to another shape, get their own
    with torch.no_grad():
        _triton(q, k, v, attn_mask=mask.clone())
        _triton(q[:1], k[:1], v[:1], attn_mask=mask[:1])
    assert len(builds) == 4
    # the entry leaves with its mask
    del mask
    assert not K._TILE_MAPS
    # inference tensors carry no version counter: built on every call
    with torch.inference_mode():
        m = cell_mask((B, 1, Lq, Lk), device, seed=10)
        for _ in range(2):
            out = _triton(q, k, v, attn_mask=m)
        torch.testing.assert_close(out, reference.attention(q, k, v, attn_mask=m))
    assert len(builds) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_a_stack_of_layers_given_one_mask_builds_one_map(device, monkeypatch):
    """fasttrans.nn translates a torch.nn mask once per mask, so the layers of a stack (and
    their backward) hand the kernels one tensor, whose tile map is built once."""
    builds = []
    build = K._build_tile_map
    monkeypatch.setattr(K, "_TILE_MAPS", {})
    monkeypatch.setattr(K, "_build_tile_map", lambda *a: builds.append(a) or build(*a))
    torch.manual_seed(11)
    layer = fasttrans.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    stack = fasttrans.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False).to(device)
    blocked = cell_mask((40, 40), device, seed=12) & ~torch.eye(40, dtype=torch.bool, device=device)  # True = blocked
    x = torch.randn(2, 40, 16, device=device, requires_grad=True)
    with fasttrans.use_backend("triton"):
        stack(x, mask=blocked).sum().backward()
    assert len(builds) == 1, f"{len(builds)} builds for one mask"
