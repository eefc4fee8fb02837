"""recipe.transcribe: the decode stage's model, features, CMVN and decoder on recordings given as files, wav.scp or
lists, from the experiment folder and from the one-file export; bad recordings named, the others transcribed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import soundfile
import torch
from omegaconf import OmegaConf

from recipe.evaluate import main as evaluate
from recipe.lib.config import load_config
from recipe.lib.experiment import Experiment
from recipe.lib.tables import read_table
from recipe.transcribe import Transcriber
from recipe.transcribe import main as transcribe
from tests.conftest import TINY


@pytest.fixture(scope="module")
def decoded(tiny_exp, tmp_path_factory):
    """The tiny corpus with an untrained model (its outputs vary from frame to frame: hypotheses of many
    characters, which any difference in features, CMVN or batching would change) through the decode stage."""
    exp = tmp_path_factory.mktemp("transcribe") / "exp"
    shutil.copytree(tiny_exp, exp)
    conf = load_config(None, TINY)
    OmegaConf.save(conf, exp / "conf.yaml")
    torch.manual_seed(0)
    model = Experiment(exp, conf).build_model(Experiment(exp, conf).input_dim)
    for p in model.parameters():
        torch.nn.init.uniform_(p, -1.0, 1.0)  # large weights: confident, changing outputs
    Experiment(exp, conf).save_checkpoint({"model": model.state_dict(), "epoch": 1,
                                           "train_state": {"history": [{"heldout_loss": 1.0}]}}, 1, 3)
    assert evaluate(["--exp", str(exp)]) == 0
    return exp


def hyps(text: str) -> dict[str, str]:
    return {line.split(" ", 1)[0]: (line.split(" ", 1) + [""])[1] for line in text.splitlines()}


def test_three_test_recordings_get_the_decode_stages_hypotheses_exactly(decoded, tmp_path, capsys):
    wav = read_table(decoded / "data" / "test" / "wav.scp")
    utts = sorted(wav)[3:6]
    expected = {u: h for u, h in hyps((decoded / "decode" / "hyp.txt").read_text()).items() if u in utts}
    assert len(set(expected.values())) == 3 and all(len(h) > 5 for h in expected.values())  # hypotheses that tell
    (tmp_path / "bad.wav").write_text("not audio")
    files = [wav[u][0] for u in utts]
    for source in (["--exp", str(decoded)], ["--model", str(decoded / "decode" / "model.pt")]):
        code = transcribe([*source, files[0], str(tmp_path / "bad.wav"), *files[1:], str(tmp_path / "gone.wav")])
        out, err = capsys.readouterr()
        assert code == 1  # some failed: a script notices
        assert hyps(out) == {wav[u][0]: expected[u] for u in utts}
        assert "bad.wav: not audio libsndfile can read" in err and "gone.wav: no such file" in err
        assert "3 of 5 recordings" in err and "real-time factor" in err
    # a wav.scp (its utt2spk beside it) prints utterance ids
    (tmp_path / "scp").mkdir()
    (tmp_path / "scp" / "wav.scp").write_text("".join(f"{u} {wav[u][0]}\n" for u in utts))
    shutil.copy(decoded / "data" / "test" / "utt2spk", tmp_path / "scp" / "utt2spk")
    assert transcribe(["--model", str(decoded / "decode" / "model.pt"), str(tmp_path / "scp" / "wav.scp")]) == 0
    assert hyps(capsys.readouterr().out) == expected


def test_the_python_api_resamples_and_knows_the_speakers(decoded):
    t = Transcriber.load(decoded / "decode" / "model.pt")
    wav = read_table(decoded / "data" / "test" / "wav.scp")
    spk = read_table(decoded / "data" / "test" / "utt2spk")
    utt = sorted(wav)[0]
    expected = hyps((decoded / "decode" / "hyp.txt").read_text())[utt]
    wave, rate = soundfile.read(wav[utt][0], dtype="float32")
    assert t.transcribe([wave], rate, [spk[utt][0]]) == [expected]  # the speaker's statistics, as decoded
    # an unknown speaker: the recording's own statistics (documented), still a transcript
    assert isinstance(t.transcribe([wave], rate)[0], str)
    with pytest.raises(Exception, match="too short"):
        t.transcribe([np.zeros(10, np.float32)], rate)


def test_silence_and_another_rate_are_said_and_still_transcribed(decoded, tmp_path, capsys):
    soundfile.write(tmp_path / "quiet.wav", np.zeros(8000, np.int16), 8000, subtype="PCM_16")
    assert transcribe(["--model", str(decoded / "decode" / "model.pt"), str(tmp_path / "quiet.wav")]) == 0
    out, err = capsys.readouterr()
    assert "quiet.wav: 8000 Hz resampled to the model's 16000 Hz" in err and "quiet.wav: silent" in err
    assert out.startswith(str(tmp_path / "quiet.wav"))
