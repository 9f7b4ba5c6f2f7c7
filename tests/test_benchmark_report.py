"""The benchmark numbers quoted in docs/ are what ``benchmarks/report.py`` renders from the
stored ``benchmarks/results/*.json`` (no benchmark runs here)."""
import json

import pytest

from benchmarks import report


def test_docs_match_stored_results():
    stale = report.stale_docs()
    assert not stale, f'stale benchmark numbers in {stale}: run python benchmarks/report.py'


def test_docs_quote_every_report():
    """Each renderer's block appears in some doc (a removed block is not silently unchecked)."""
    import glob
    text = ''.join(open(p).read() for p in glob.glob(f'{report.ROOT}/docs/*.md'))
    for name in report.RENDERERS:
        assert f'<!-- report:{name} -->' in text


def test_regenerate_rewrites_only_the_block(tmp_path):
    payload = json.load(open(f'{report.RESULTS}/checkpoint_load_memory.json'))
    payload['max_ratio'] = 9.87
    (tmp_path / 'checkpoint_load_memory.json').write_text(json.dumps(payload))
    doc = 'before\n<!-- report:checkpoint_load_memory -->\nold 0.5\n<!-- /report -->\nafter\n'
    new = report.regenerate(doc, str(tmp_path))
    assert new.startswith('before\n<!-- report:checkpoint_load_memory -->\n')
    assert new.endswith('<!-- /report -->\nafter\n')
    assert 'max 9.87' in new and 'old 0.5' not in new
    assert report.regenerate(new, str(tmp_path)) == new


def test_unknown_block_is_an_error(tmp_path):
    with pytest.raises(KeyError, match='unknown report block'):
        report.regenerate('<!-- report:nope -->\n<!-- /report -->', str(tmp_path))


def test_heldout_tables_follow_the_stored_verdicts_and_bars():
    """The held-out block's verdicts come from the JSON's targets, and bold marks a case at
    the bar (τ ≥ 0.8, regret ≤ 10 %), not a fixed list."""
    d = json.load(open(f'{report.RESULTS}/planner_accuracy_heldout.json'))
    d['targets']['tau']['passed'] = True
    d['cases'][0].update(kendall_tau=0.81, pick_regret=0.11)
    text = report.render_planner_accuracy_heldout(d)
    row = next(line for line in text.splitlines()
               if line.startswith(f"| {d['cases'][0]['model']}-{d['cases'][0]['size']} "
                                  f"{d['cases'][0]['budget']} |"))
    assert '| **0.81** (' in row and '| 11 % |' in row
    tau_line = next(line for line in text.splitlines() if line.startswith('| τ ≥'))
    assert tau_line.endswith('| **pass** |')
