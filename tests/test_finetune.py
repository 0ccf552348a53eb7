"""Fine-tuning a body with its head (ken.models.finetune) on the real MiniLM-L3."""

from __future__ import annotations

import numpy as np
import pytest

from ken.errors import ModelError
from ken.models import family
from ken.models.datasets import LabelledSample
from ken.models.finetune import FineTune, fine_tune
from ken.models.model import DeviceConfig
from ken.models.transformers_backend import BodyConfig, TransformersBody

GOOD = ["great", "lovely", "wonderful day", "so happy", "brilliant", "i love it", "superb",
        "fantastic news", "what a joy", "amazing"]
BAD = ["awful", "horrible", "terrible day", "so sad", "dreadful", "i hate it", "disgusting",
       "tragic news", "what a mess", "pathetic"]


def sample() -> LabelledSample:
    return LabelledSample("toy", tuple(GOOD + BAD), np.array([1] * 10 + [0] * 10),
                          ("negative", "positive"))


@pytest.mark.models
def test_fine_tuning_learns_and_saves_a_loadable_body(home, tmp_path) -> None:
    config = BodyConfig(str(family.body_dir(family.member("minilm-l3"), home)))
    device = DeviceConfig(threads=2)
    before = TransformersBody(config, device).net.state_dict()
    saved, head = fine_tune(config, sample(), tmp_path / "all",
                            FineTune(epochs=8, learning_rate=1e-4, batch_size=8), device)
    body = TransformersBody(saved, device)
    probs = head.predict_proba(body.features(list(GOOD + BAD)))
    assert (probs.argmax(axis=1) == sample().labels).mean() >= 0.9  # fits its training rows
    after = body.net.state_dict()
    assert not np.allclose(before["embeddings.word_embeddings.weight"].numpy(),
                           after["embeddings.word_embeddings.weight"].numpy())
    # top_layers=1 trains the last layer only: the embeddings and layer 0 stay as they were
    saved, _ = fine_tune(config, sample(), tmp_path / "top",
                         FineTune(epochs=2, batch_size=8, top_layers=1), device)
    top = TransformersBody(saved, device).net.state_dict()
    for name in ("embeddings.word_embeddings.weight",
                 "encoder.layer.0.attention.self.query.weight"):
        assert np.array_equal(before[name].numpy(), top[name].numpy()), name
    last = "encoder.layer.2.attention.self.query.weight"
    assert not np.array_equal(before[last].numpy(), top[last].numpy())


def test_bad_settings_and_data() -> None:
    with pytest.raises(ModelError):
        FineTune(epochs=0)
    with pytest.raises(ModelError):
        FineTune(top_layers=0)
    one = LabelledSample("one", ("a",), np.array([0]), ("x",))
    with pytest.raises(ModelError, match="one class"):
        fine_tune(BodyConfig("unused"), one, None)  # type: ignore[arg-type]
