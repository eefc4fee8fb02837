"""The numpy beam search against flashlight-text's lexicon decoder (``decode.backend``) on the same model
outputs: the held-out set's logits are computed once, then decoded by each backend with the same ARPA file,
beam, LM weight and word bonus. Printed, and written to EXP/OUT/compare.json: the seconds each
decoder took (decoding alone: the model's forward pass is shared and not timed), the CER/WER of each, how many
hypotheses are identical, and the ones that differ (ACCURACY.md section 7).

    python -m recipe.tools.compare_decoders --exp EXP [--out compare-decoders] [decode.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import torch

from recipe.evaluate import beam_decoder, error_counts
from recipe.lib.config import load_config
from recipe.lib.dataset import BucketBatchSampler
from recipe.lib.experiment import Experiment


@torch.no_grad()
def heldout_logits(exp: Experiment, conf) -> tuple[list, list[str], list[str]]:
    """-> ([(logits, lengths)] per batch, references, utterance ids), with the decode stage's averaged model."""
    model, _ = exp.load_model(None, conf.decode.average_last, conf.decode.average_within)
    model.eval()
    data = exp.dataset("test")
    batches = BucketBatchSampler(data.lengths, 16, shuffle=False).epoch_batches(0)
    outputs, refs, utts = [], [], []
    for batch in batches:
        b = data.collate(batch)
        logits, lengths = model(b["feats"], b["lengths"])
        outputs.append((logits.float(), lengths))
        refs += [data.texts[k] for k in batch]
        utts += [data.utt(k) for k in batch]
    return outputs, refs, utts


def compare(outputs: list, refs: list[str], utts: list[str], tokens: list[str],
            decoders: dict[str, Callable]) -> dict:
    """Decode the same outputs [(logits, lengths)] with two decoders {name: decode(logits, lengths, tokens)}
    -> {name: seconds, CER, WER} per decoder, how many hypotheses are identical, and those that differ."""
    hyps, result = {}, {}
    for name, decode in decoders.items():
        t0 = time.perf_counter()
        hyps[name] = [h for logits, lengths in outputs for h in decode(logits, lengths, tokens)]
        seconds = time.perf_counter() - t0
        errors = error_counts(refs, hyps[name])
        result[name] = {"seconds": seconds, "cer": errors["char_errors"] / errors["chars"],
                        "wer": errors["word_errors"] / errors["words"]}
    first, second = decoders
    differ = [{"utt": u, "ref": r, first: a, second: b}
              for u, r, a, b in zip(utts, refs, hyps[first], hyps[second]) if a != b]
    return {**result, "utterances": len(refs), "identical": len(refs) - len(differ), "differ": differ}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True)
    p.add_argument("--out", default="compare-decoders", help="folder under EXP for compare.json (and lm.arpa)")
    p.add_argument("overrides", nargs="*", help="decode.key=value over EXP/conf.yaml's decode section")
    args = p.parse_args(argv)
    exp = Experiment(args.exp)
    out = exp.root / args.out
    out.mkdir(exist_ok=True)
    confs = {name: load_config(exp.root / "conf.yaml", [*args.overrides, f"decode.backend={name}"])
             for name in ("numpy", "flashlight")}
    outputs, refs, utts = heldout_logits(exp, confs["numpy"])
    # the numpy backend's call trains the LM and writes out/lm.arpa (unless decode.lm_arpa): flashlight reads it
    decoders = {name: beam_decoder(conf.decode, exp.data_dir("train") / "text", out, exp.tokens)
                for name, conf in confs.items()}
    result = {"decode": {k: v for k, v in confs["numpy"].decode.items() if k != "backend"},
              **compare(outputs, refs, utts, exp.tokens, decoders)}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "differ"}))
    for d in result["differ"]:
        print(f"{d['utt']}\n  ref        {d['ref']}\n  numpy      {d['numpy']}\n  flashlight {d['flashlight']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
