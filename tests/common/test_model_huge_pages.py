"""The decoder's packed weights in one buffer advised for 2 MiB pages (huge_pages.py): the same
values, each on a cache line, in the order given; left alone when turned off; correct when the
OS refuses the advice; and, where the OS has transparent huge pages, on huge pages."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sssd.common.model import huge_pages
from sssd.common.model.huge_pages import HUGE_PAGE, move_into_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def holders(*sizes):
    torch.manual_seed(0)
    return [SimpleNamespace(weight=torch.randn(size, 3).to(torch.bfloat16)) for size in sizes]


def test_the_weights_move_into_one_buffer_unchanged(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    moved = holders(5, 1000, 7, 300_000)
    originals = [h.weight.clone() for h in moved]
    move_into_huge_pages(moved)
    storage = moved[0].weight.untyped_storage().data_ptr()
    addresses = [h.weight.data_ptr() for h in moved]
    assert addresses[0] % HUGE_PAGE == 0  # the buffer's 2 MiB-aligned interior
    assert addresses == sorted(addresses)  # in the order given: the order a step reads them
    for holder, original in zip(moved, originals):
        assert holder.weight.untyped_storage().data_ptr() == storage
        assert holder.weight.data_ptr() % huge_pages.ALIGN == 0
        assert holder.weight.is_contiguous() and holder.weight.dtype == original.dtype
        assert torch.equal(holder.weight, original)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_turned_off_the_weights_stay_where_they_are(monkeypatch, value):
    monkeypatch.setenv(huge_pages.ENV, value)
    kept = holders(10, 20)
    before = [h.weight for h in kept]
    move_into_huge_pages(kept)
    assert all(h.weight is w for h, w in zip(kept, before))


def test_a_refused_advice_leaves_correct_weights(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    monkeypatch.setattr(huge_pages, "_advise", lambda address, length: False)
    moved = holders(64, 4096)
    originals = [h.weight.clone() for h in moved]
    move_into_huge_pages(moved)
    assert all(torch.equal(h.weight, w) for h, w in zip(moved, originals))


def anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this OS has no transparent huge pages")
def test_where_the_os_has_them_the_weights_are_on_huge_pages(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    before = anon_huge_kb()
    moved = [SimpleNamespace(weight=torch.ones(4 * HUGE_PAGE, dtype=torch.uint8))]
    move_into_huge_pages(moved)
    # 8 MiB copied into an advised buffer: at least three whole 2 MiB pages of it
    assert anon_huge_kb() - before >= 3 * HUGE_PAGE // 1024
    del moved


def test_the_decoder_keeps_its_packed_weights_in_one_buffer(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sssd.common.model.decoder import Decoder

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval().to(torch.bfloat16)
    decoder = Decoder(model)
    if decoder.layout not in ("panels", "amx"):
        pytest.skip(f"layout {decoder.layout}: its weights are oneDNN's or the model's own")
    linears = [linear for layer in decoder.layers
               for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [decoder.lm_head]
    storages = {linear.weight.untyped_storage().data_ptr() for linear in linears}
    assert len(storages) == 1
