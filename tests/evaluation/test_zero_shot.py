"""zero_shot over lm-eval with local tasks only: the shipped BBC topic task on a tiny model, custom YAMLs, and clear
errors for a missing YAML or one that needs the Hub."""

import json
import os

import pytest

from optimum_prune.evaluation.tasks import BBC_LABELS, bbc_news_topic_task
from optimum_prune.evaluation.zero_shot import resolve_tasks, zero_shot


def test_bbc_task_data_is_the_held_out_half_and_mixes_topics(tmp_path):
    from optimum_prune.calibration.data import bbc_news_dir, load_texts, split_documents

    task = bbc_news_topic_task(tmp_path, max_chars=200)
    rows = [json.loads(line) for line in (task.parent / "test.jsonl").read_text().splitlines()]
    docs = load_texts(bbc_news_dir())
    held_out = split_documents(docs, 0.5, 0)[1]
    assert len(rows) == len(held_out)
    assert {r["label"] for r in rows[:30]} == set(range(len(BBC_LABELS)))  # shuffled: the first rows mix topics
    assert all(len(r["text"]) <= 204 for r in rows)
    assert rows[0]["text"].split("\n")[0] in {d.split("\n")[0] for d in held_out}


def test_bbc_task_restricted_to_given_documents(tmp_path):
    from optimum_prune.calibration.data import bbc_news_dir, load_texts

    docs = load_texts(bbc_news_dir())
    chosen = docs[5:45:3]
    task = bbc_news_topic_task(tmp_path, max_chars=10_000, documents=chosen)
    rows = [json.loads(line) for line in (task.parent / "test.jsonl").read_text().splitlines()]
    assert sorted(r["text"].split("\n")[0] for r in rows) == sorted(d.strip().splitlines()[0].strip() for d in chosen)
    assert task != bbc_news_topic_task(tmp_path, max_chars=10_000)  # another document set: another task directory
    with pytest.raises(ValueError, match="1 of 2 texts are not BBC articles"):
        bbc_news_topic_task(tmp_path, documents=[docs[0], "not an article"])


def test_bbc_task_built_by_two_processes_at_once(tmp_path, monkeypatch):
    # another process builds the same task between this one's write and rename: both finish, with whole files
    from optimum_prune.evaluation import tasks

    replace, nested = os.replace, []

    def interleaved(src, dst):
        if not nested:
            nested.append(True)
            tasks.bbc_news_topic_task(tmp_path, max_chars=50)  # the "other process", start to end
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interleaved)
    task = tasks.bbc_news_topic_task(tmp_path, max_chars=50)
    rows = (task.parent / "test.jsonl").read_text().splitlines()
    assert rows and all(json.loads(r)["text"] for r in rows)
    assert "__DATA_FILE__" not in task.read_text()
    assert sorted(p.name for p in task.parent.iterdir()) == ["bbc_news_topic.yaml", "test.jsonl"]  # no temp left


def test_zero_shot_bbc_topic_on_a_tiny_model(tiny_llama, smollm2_tokenizer, tmp_path):
    res = zero_shot(tiny_llama, smollm2_tokenizer, ["bbc_news_topic"], limit=10, cache_dir=tmp_path)
    r = res["bbc_news_topic"]
    assert r["samples"] == 10 and 0.0 <= r["acc"] <= 1.0 and "acc_norm" in r and "acc_stderr" in r
    assert r["acc"] * 10 == pytest.approx(round(r["acc"] * 10))  # an accuracy over 10 documents


def test_custom_local_yaml(tiny_llama, smollm2_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"Is {i} even?", "label": i % 2}) for i in range(6)) + "\n")
    (tmp_path / "parity.yaml").write_text(
        "task: parity_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{q}}}}'\n"
        "doc_to_target: label\ndoc_to_choice: ['yes', 'no']\nmetric_list:\n  - metric: acc\n"
    )
    res = zero_shot(tiny_llama, smollm2_tokenizer, [str(tmp_path / "parity.yaml")])
    assert res["parity_local"]["samples"] == 6


def test_missing_or_hub_tasks_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_tasks([str(tmp_path / "nope.yaml")])
    hub = tmp_path / "hub.yaml"
    hub.write_text("task: arc_like\ndataset_path: allenai/ai2_arc\noutput_type: multiple_choice\n")
    with pytest.raises(ValueError, match="needs the Hugging Face Hub"):
        resolve_tasks([str(hub)])
    missing = tmp_path / "missing.yaml"
    missing.write_text("task: m\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: absent.jsonl\n")
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        resolve_tasks([str(missing)])
    with pytest.raises(ValueError, match="allow_hub=True"):
        resolve_tasks(["arc_easy"])
