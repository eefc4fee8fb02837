"""The numpy beam search against flashlight-text's lexicon decoder (``decode.backend``) on the same model
outputs: the dev set's logits are computed once, then decoded by each backend with the same ARPA file, beam,
LM weight and word bonus (the decode stage's choice, or as set). Printed, and written to EXP/OUT/compare.json:
the seconds each decoder took (decoding alone: the model's forward pass is shared and not timed), the CER/WER of
each, how many hypotheses are identical, and the ones that differ (ACCURACY.md section 7).

    python -m recipe.tools.compare_decoders --exp EXP [--out compare-decoders] [decode.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

from omegaconf import OmegaConf

from recipe.evaluate import Pass, batches_of, beam_decoder, error_counts, word_lm
from recipe.lib.config import load_config
from recipe.lib.experiment import Experiment


def dev_outputs(exp: Experiment, conf) -> Pass:
    """The dev set through the decode stage's averaged model, once."""
    model, _ = exp.load_model(None, conf.decode.average_best, conf.decode.average_within)
    data = exp.dataset("dev")
    return Pass(model, data, batches_of(data), exp.tokens)


def decode_weights(exp: Experiment, decode) -> dict:
    """The LM weight and word bonus: as set on the command line, else the decode stage's choice on dev."""
    scores = exp.root / "decode" / "scores.json"
    chosen = json.loads(scores.read_text())["decode"] if scores.is_file() else {}
    weights = {k: decode[k] if decode[k] is not None else chosen.get(k) for k in ("lm_weight", "word_bonus")}
    missing = [k for k, v in weights.items() if v is None]
    if missing:
        raise SystemExit(f"compare_decoders: no decode stage has chosen {missing} yet ({scores}): run it, or set "
                         f"{' and '.join(f'decode.{k}=...' for k in missing)}")
    return weights


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
    dev = dev_outputs(exp, confs["numpy"])
    refs, utts = [r for _, r, _ in dev.greedy], [u for u, _, _ in dev.greedy]
    decode = confs["numpy"].decode
    lm = word_lm(decode, exp.data_dir("train") / "text", out)  # writes out/lm.arpa (unless decode.lm_arpa)
    arpa = decode.lm_arpa or out / "lm.arpa"
    weights = decode_weights(exp, decode)
    decoders = {name: beam_decoder(conf.decode, lm, arpa, exp.tokens, **weights) for name, conf in confs.items()}
    result = {"decode": {**{k: v for k, v in OmegaConf.to_container(decode).items() if k != "backend"}, **weights},
              **compare(dev.outputs, refs, utts, exp.tokens, decoders)}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "differ"}))
    for d in result["differ"]:
        print(f"{d['utt']}\n  ref        {d['ref']}\n  numpy      {d['numpy']}\n  flashlight {d['flashlight']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
