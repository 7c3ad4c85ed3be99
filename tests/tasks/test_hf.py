"""Hugging Face transformers, tokenizers and datasets, with nothing downloaded: a GPT-2 built
from a config on a BPE tokenizer trained on the Python docs (experiment=hf_causal_lm), a bare
PreTrainedModel given through _target_, local text files read through datasets, the model
saved in transformers' own form and loaded back in plain transformers, FSDP2 under torchrun,
and the bad input of this path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, torchrun

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

SMALL = ["data.max_chars=60000", "trainer.max_epochs=2"]


@pytest.mark.slow
@pytest.mark.long(seconds=62)
def test_hf_causal_lm_trains_saves_for_transformers_and_evaluates(tmp_path):
    work = tmp_path / "runs" / "lm"
    home = tmp_path / "home"
    home.mkdir()
    proc = run_cli(f"hydra.run.dir={work}", "experiment=hf_causal_lm", *SMALL, env={"HOME": str(home)})
    assert proc.returncode == 0, proc.output[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed"
    history = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    perplexities = [h["val/perplexity"] for h in history if "val/perplexity" in h]
    assert len(perplexities) == 2 and perplexities[1] < perplexities[0] < 2000  # learning, below uniform
    samples = (work / "samples.txt").read_text()
    assert samples.count("--- epoch") == 4 and "The" in samples  # 2 samples after each validation
    # the tokenizer was trained once and cached beside the work dirs, nothing in the home dir
    assert len(list((tmp_path / "runs" / ".hf_cache" / "tokenizers").glob("bpe-*.json"))) == 1
    assert not [p for p in home.rglob("*") if "huggingface" in p.name or "datasets" in p.name]

    # transformers' own form loads in plain transformers and computes what expkit's checkpoint does
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(work / "hf_model"))
    tokenizer = AutoTokenizer.from_pretrained(str(work / "hf_model"))
    ids = tokenizer("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    last = torch.load(work / "checkpoints" / "epoch_2.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(v, last[f"model.{k}"]) for k, v in model.state_dict().items() if f"model.{k}" in last)
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))

    evaluated = subprocess.run(
        [sys.executable, "-m", "expkit.eval", f"checkpoint={work}", "which=best", f"work_dir={tmp_path / 'eval'}"],
        capture_output=True,
        text=True,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    got = json.loads((tmp_path / "eval" / "result.json").read_text())["final_metrics"]
    assert got["test/perplexity"] == pytest.approx(result["final_metrics"]["test/perplexity"], rel=1e-6)

    # expkit.predict continues prompts with model.generate (greedy: what plain transformers generates)
    (tmp_path / "prompts.txt").write_text("def \nThe for statement\n")
    predicted = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.predict",
            f"checkpoint={work}",
            "which=last",
            f"input={tmp_path / 'prompts.txt'}",
            f"output={tmp_path / 'out.jsonl'}",
            "max_new_tokens=12",
            f"hydra.run.dir={tmp_path / 'pred'}",
        ],
        capture_output=True,
        text=True,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["input"] for r in rows] == ["def ", "The for statement"]
    expected = tokenizer.decode(
        model.generate(
            tokenizer("def ", return_tensors="pt")["input_ids"],
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[0],
        skip_special_tokens=True,
    )
    assert rows[0]["text"] == expected and rows[0]["text"].startswith("def ")
    sampled = [  # temperature > 0 samples, from the seed: twice the same
        subprocess.run(
            [
                sys.executable,
                "-m",
                "expkit.predict",
                f"checkpoint={work}",
                f"input={tmp_path / 'prompts.txt'}",
                f"output={tmp_path / f'sampled{n}.jsonl'}",
                "max_new_tokens=12",
                "temperature=1.5",
                "seed=3",
                f"hydra.run.dir={tmp_path / f'sample{n}'}",
            ],
            capture_output=True,
            text=True,
        )
        for n in (0, 1)
    ]
    assert all(p.returncode == 0 for p in sampled), sampled[0].stderr[-3000:]
    texts = [(tmp_path / f"sampled{n}.jsonl").read_text() for n in (0, 1)]
    assert texts[0] == texts[1] and json.loads(texts[0].splitlines()[0])["text"].startswith("def ")

    # any checkpoint, not only the end of the run, exports to transformers' own form
    first = work / "checkpoints" / "epoch_1.pth"
    exported = tmp_path / "export" / "epoch_1_hf"
    for attempt in (0, 1):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "expkit.export",
                f"checkpoint={first}",
                "format=hf",
                f"out={exported}",
                f"hydra.run.dir={tmp_path / 'export'}",
            ],
            capture_output=True,
            text=True,
        )
        if attempt:  # a second export into the same directory would mix two models' files
            assert proc.returncode == 2 and "holds files already; give a new directory" in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr[-3000:]
    early = AutoModelForCausalLM.from_pretrained(str(exported))
    weights = torch.load(first, weights_only=True)["state_dict"]
    assert all(torch.equal(v, weights[f"model.{k}"]) for k, v in early.state_dict().items() if f"model.{k}" in weights)
    assert not torch.equal(early.lm_head.weight, model.lm_head.weight)  # epoch 1's weights, not the last ones
    assert AutoTokenizer.from_pretrained(str(exported))("def f")["input_ids"] == tokenizer("def f")["input_ids"]
    info = json.loads((exported.parent / "epoch_1_hf.json").read_text())
    assert info["format"] == "hf" and info["input_shape"]["input_ids"][0] == "batch"


@pytest.mark.slow
def test_hf_text_classification_tells_packages_apart_and_classifies_new_texts(tmp_path):
    work = tmp_path / "runs" / "tc"
    proc = run_cli(
        f"hydra.run.dir={work}", "experiment=hf_text_classification", "trainer.max_epochs=4", "data.max_per_class=300"
    )
    assert proc.returncode == 0, proc.output[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert result["final_metrics"]["val/acc"] > 0.6  # 4 packages: chance is 0.25
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(work / "hf_model"))
    assert model.config.num_labels == 4

    (tmp_path / "texts.txt").write_text("from email.message import Message\nclass T(unittest.TestCase):\n")
    predicted = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.predict",
            f"checkpoint={work}",
            "top_k=4",
            f"input={tmp_path / 'texts.txt'}",
            f"output={tmp_path / 'out.jsonl'}",
            f"hydra.run.dir={tmp_path / 'pred'}",
        ],
        capture_output=True,
        text=True,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["top_k"]) == 4 for r in rows)
    assert {c for c, _ in rows[0]["top_k"]} == {"asyncio", "email", "unittest", "xml"}  # named by package
    assert abs(sum(p for _, p in rows[0]["top_k"]) - 1) < 1e-4


def test_text_classes_from_a_csv_file_in_bf16_from_a_model_plain_transformers_saved(tmp_path):
    """A CSV of your own; the model starts from a directory plain transformers wrote (another
    size than the shipped config, another head: resized to the data's classes), in bf16."""
    from transformers import BertConfig, BertForSequenceClassification

    lines = [f"{'the cat sat on the mat' if i % 2 else 'def f(x): return x'} {i}" for i in range(200)]
    (tmp_path / "texts.csv").write_text(
        "text,label\n" + "".join(f"{line},{'prose' if i % 2 else 'code'}\n" for i, line in enumerate(lines))
    )
    for name, vocab in (("bert", 400), ("small_vocab", 50)):
        config = BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=7,
        )
        BertForSequenceClassification(config).save_pretrained(str(tmp_path / name))
    common = [
        "experiment=hf_text_classification",
        "trainer.max_epochs=2",
        f"data.source={tmp_path / 'texts.csv'}",
        "data.vocab_size=300",
        "hooks=[]",
        "trainer.precision=bf16",
    ]
    work = tmp_path / "runs" / "csv"
    proc = run_cli(f"hydra.run.dir={work}", *common, f"model.pretrained={tmp_path / 'bert'}")
    assert proc.returncode == 0, proc.output[-3000:]
    assert json.loads((work / "result.json").read_text())["final_metrics"]["val/acc"] == 1.0
    weights = torch.load(work / "checkpoints" / "epoch_2.pth", weights_only=True)["state_dict"]
    assert weights["model.bert.embeddings.word_embeddings.weight"].shape == (400, 32)  # the saved model's size
    assert weights["model.classifier.weight"].shape == (2, 32)  # its 7-label head, resized to the 2 classes
    # a model whose embedding cannot hold the data's token ids: named before the first step
    proc = run_cli(
        f"hydra.run.dir={tmp_path / 'runs' / 'small'}", *common, f"model.pretrained={tmp_path / 'small_vocab'}"
    )
    assert proc.returncode == 2, proc.output[-3000:]
    assert "the model embeds 50 token ids but the data's tokenizer has" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_bare_pretrained_model_and_text_files_read_through_datasets(tmp_path):
    """A PreTrainedModel given as it is (its own class and config through _target_) trains on
    dict batches with its own loss; local text files go through datasets' text loader, cached
    in data.cache_dir."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))[:80000]
    (corpus / "a.txt").write_text(text[:40000])
    (corpus / "b.txt").write_text(text[40000:])
    work = tmp_path / "runs" / "bare"  # the docs' example: examples/my_project/conf/model/my_gpt2.yaml
    proc = run_cli(
        "--config-dir",
        str(REPO / "examples" / "my_project" / "conf"),
        f"hydra.run.dir={work}",
        "experiment=hf_causal_lm",
        "model=my_gpt2",
        "trainer.max_epochs=1",
        f"data.text={corpus}/*.txt",
        "hooks=[]",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Model HFModel" in proc.output and "GPT2LMHeadModel" in (work / ".hydra" / "config.yaml").read_text()
    assert json.loads((work / "result.json").read_text())["status"] == "completed"
    assert list((tmp_path / "runs" / ".hf_cache" / "datasets").iterdir())  # datasets' cache, beside the runs


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer=/nonexistent/tokenizer.json: no such file"),
        (["data.text=/nonexistent/*.txt"], "data.text=/nonexistent/*.txt: no such file"),
        (["data.text=EMPTY"], "the text is empty"),
        (["data.text=ZEROBYTES"], "the text is empty"),
        (["data.text="], "data.text is empty: give pydoc, or the path or glob of text files"),
        (["data.text=''"], "data.text is empty: give pydoc, or the path or glob of text files"),
        (["data.text=DIR"], "is a directory; give the text files in it, e.g. data.text='"),
        (["data.tokenizer=NOTATOKENIZER"], "not a tokenizer.json tokenizers can read"),
        (["model.pretrained=/nonexistent"], "model.pretrained=/nonexistent: not a local model directory"),
        (["model.config.model_type=gtp2"], "model_type='gtp2' is not a transformers model type; close matches: gpt2"),
        (["model.config.n_positions=32"], "model.config allows 32 positions, fewer than data.block_size=64"),
        (["experiment=hf_text_classification", "data.source=NOLABEL"], "no label column (it has text)"),
        (
            ["experiment=hf_text_classification", "data.source=/nonexistent.csv"],
            "data.source=/nonexistent.csv: give stdlib, or a .csv or .jsonl file",
        ),
        (
            ["experiment=hf_text_classification", "data.packages=[asyncio,nosuchpackage]"],
            "data.packages: nosuchpackage is not a standard-library package",
        ),
    ],
    ids=[
        "tokenizer file",
        "text files",
        "empty text",
        "zero-byte text file",
        "text unset",
        "text quoted empty",
        "text dir",
        "tokenizer not json",
        "pretrained dir",
        "model type",
        "positions",
        "csv columns",
        "csv file",
        "package",
    ],
)
def test_bad_input_exits_2_in_one_line(tmp_path, overrides, says):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    (tmp_path / "zero.txt").write_bytes(b"")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("a line of text\n")
    (tmp_path / "notes.txt").write_text("not a tokenizer\n")
    (tmp_path / "nolabel.csv").write_text("text\nhello\n")
    named = {
        "ZEROBYTES": tmp_path / "zero.txt",
        "EMPTY": empty,
        "NOLABEL": tmp_path / "nolabel.csv",
        "DIR": tmp_path / "texts",
        "NOTATOKENIZER": tmp_path / "notes.txt",
    }
    for placeholder, path in named.items():
        overrides = [o.replace(placeholder, str(path)) for o in overrides]
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=hf_causal_lm", *SMALL, *overrides]
    proc = run_cli(f"hydra.run.dir={tmp_path / 'runs' / 'bad'}", *overrides)
    assert proc.returncode == 2, proc.output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_fsdp2_trains_a_transformers_model_and_saves_it_whole(tmp_path):
    work = tmp_path / "runs" / "fsdp"
    proc = torchrun(
        f"hydra.run.dir={work}",
        "experiment=hf_causal_lm",
        *SMALL,
        "trainer.strategy=fsdp",
        "hooks=[hf_save_pretrained,hf_samples]",
        "trainer.accumulate_grad_batches=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "checkpoints" / "epoch_2.dcp").is_dir()
    samples = (work / "samples.txt").read_text()  # generated on both ranks together, written by rank 0
    assert samples.count("--- epoch") == 4 and "\nThe " in samples, samples
    from safetensors.torch import load_file

    from expkit.checkpoint import dcp

    saved = load_file(str(work / "hf_model" / "model.safetensors"))
    shards = dcp.read_weights(work / "checkpoints" / "epoch_2.dcp")
    assert all(torch.equal(saved[k], shards[f"model.{k}"]) for k in saved if f"model.{k}" in shards)
    assert len([k for k in saved if f"model.{k}" in shards]) > 20  # the whole model, gathered from both ranks


def _text_files(where: Path) -> str:
    """Two text files of the Python documentation topics (a topic a line), as a user's corpus."""
    from pydoc_data.topics import topics

    texts = [topics[key].replace("\n", " ") for key in sorted(topics)]
    where.mkdir(parents=True, exist_ok=True)
    (where / "a.txt").write_text("\n".join(texts[:60]))
    (where / "b.txt").write_text("\n\n".join(texts[60:120]))  # (blank lines are no documents)
    return str(where / "*.txt")


def test_streamed_text_gives_the_same_blocks_from_token_files(tmp_path):
    # data.streaming=true: the text files through datasets' streaming into memory-mapped token files
    # (issue 54, item 5): the same split and blocks as in memory
    from expkit.tasks.hf.text_blocks import TextBlocks, _TokenBlocks

    text = _text_files(tmp_path / "corpus")
    kept = {"text": text, "cache_dir": str(tmp_path / "cache"), "test_fraction": 0.1, "max_chars": 150_000}
    in_memory = TextBlocks(**kept).datasets()
    streamed = TextBlocks(**kept, streaming=True).datasets()
    assert isinstance(streamed[0].blocks, _TokenBlocks) and not isinstance(in_memory[0].blocks, _TokenBlocks)
    for a, b in zip(in_memory, streamed, strict=True):
        assert len(a) == len(b) > 0
        assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))
    files = sorted(p.name for p in (tmp_path / "cache" / "token_blocks").iterdir())
    assert len(files) == 1  # written once; a second module reads them
    assert TextBlocks(**kept, streaming=True).datasets()[0].blocks.path.parent.name == files[0]


@pytest.mark.slow
def test_a_streamed_causal_lm_resumes_exactly(tmp_path):
    from expkit.testing import assert_resumes_exactly

    text = _text_files(tmp_path / "corpus")
    report = assert_resumes_exactly(
        "experiment=hf_causal_lm",
        f"data.text={text}",
        "data.streaming=true",
        "data.max_chars=60000",
        f"data.cache_dir={tmp_path / 'cache'}",
        scratch=tmp_path / "scratch",
    )
    assert report["ok"]
