"""HF conventions of K3ForCausalLM.forward: the result is a `CausalLMOutput` (`.logits`, `.past_key_values`, and with
`labels=` `.loss`: shifted cross-entropy, -100 ignored); `return_dict=False` gives the bare logits tensor; configs we
build carry no auto_map to modeling files the folder does not hold (a release's own is kept)."""

import json

import pytest
import torch
from fixture_paths import PLAIN

from openk3.config import K3Config
from openk3.model.model import CausalLMOutput, K3ForCausalLM


@pytest.fixture(scope="module")
def tiny():
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(seed=0)
    return model.eval()


def test_labels_give_the_shifted_loss_and_ignore_minus_100(tiny):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny.text_config.vocab_size, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # e.g. a prompt
    labels[1, -1] = -100
    with torch.no_grad():
        bare = tiny(ids).logits
        out = tiny(ids, labels=labels)
    assert isinstance(out, CausalLMOutput) and torch.equal(out.logits, bare) and out.past_key_values is None
    # The reference: each kept (row, t) pair's -log softmax(logits[t])[labels[t + 1]], averaged.
    logp = torch.log_softmax(bare.double(), -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(10) if labels[b, t + 1] != -100]
    assert len(terms) == 2 * 10 - 3 - 1
    torch.testing.assert_close(out.loss.double(), torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)
    all_ignored = torch.full_like(ids, -100)
    with torch.no_grad():
        assert torch.isnan(tiny(ids, labels=all_ignored).loss)  # as HF: a mean over no tokens
    with pytest.raises(ValueError, match="labels shape"):
        tiny(ids, labels=labels[:, :-1])


def test_return_dict_and_cache(tiny):
    ids = torch.randint(0, tiny.text_config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    cache = tiny.new_cache(1)
    with torch.no_grad():
        out = tiny(ids, None, cache)
        assert isinstance(out, CausalLMOutput) and out.loss is None and out.past_key_values is cache
        bare = tiny(ids, return_dict=False)
        assert isinstance(bare, torch.Tensor) and torch.equal(out.logits, bare)
    with pytest.raises(ValueError, match="leave return_dict=True"):
        tiny(ids, labels=ids, return_dict=False)
    loss = tiny(ids, labels=ids).loss  # differentiable
    loss.backward()
    assert tiny.lm_head.weight.grad is not None
    tiny.zero_grad(set_to_none=True)


def test_saved_configs_name_no_missing_modeling_files(tmp_path):
    K3ForCausalLM(K3Config.preset("tiny")).config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in data and "auto_map" not in data["text_config"]
    official = K3Config.from_pretrained(PLAIN)  # a release's own auto_map is kept (it ships the files)
    assert official.auto_map["AutoModel"] == "modeling_kimi_k3.KimiK3ForConditionalGeneration"
    assert official.text_config.auto_map is not None
