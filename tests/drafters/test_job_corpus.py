"""The job corpus: the n-gram drafter's fallback on the job's earlier records.

Strict outputs stay equal to transformers' greedy generate() with the corpus on (it only
changes drafts); the corpus is built for strict verification only; a record joins it when its
row leaves; bench forgets the warm-up; old records leave within the token budget.
"""

from __future__ import annotations

import pytest

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import RowDrafters
from marscli.drafters.ngram import JobCorpus, NgramDrafter
from marscli.engine import build_engine
from tests.engines import make_engine
from tests.oracles import hf_greedy


def test_a_record_without_its_own_match_drafts_from_the_corpus():
    corpus = JobCorpus(3)
    corpus.add([1, 2, 3, 4, 5, 6, 7])
    d = NgramDrafter(8, ngram_max=3, corpus=corpus)
    d.start([9, 2, 3])
    seq = [9, 2, 3, 4]
    offer = d.offer(seq, 8)
    assert offer.available == 3  # 5, 6, 7 follow "2 3 4" in the earlier record
    assert d.propose(seq, 3).tokens == [5, 6, 7]
    # without the corpus the same record has nothing to draft
    alone = NgramDrafter(8, ngram_max=3)
    alone.start([9, 2, 3])
    assert alone.offer(seq, 8).available == 0


@pytest.mark.parametrize("n,earlier,seq,drafts", [
    (2, [1, 2, 50, 51], [1, 2, 60, 61, 1, 2], [60, 61]),  # a full-length match of its own wins
    (3, [7, 8, 9, 40, 41], [9, 30, 7, 8, 9], [40, 41]),  # own: "9" (n = 1) -> 30; corpus: "7 8 9" (n = 3)
], ids=["own-full-length-wins", "longer-corpus-match-wins"])
def test_the_longer_match_wins_whether_its_own_or_the_corpus(n, earlier, seq, drafts):
    corpus = JobCorpus(n)
    corpus.add(earlier)
    d = NgramDrafter(8, ngram_max=n, corpus=corpus)
    d.start(seq)
    d.offer(seq, 8)
    assert d.propose(seq, 2).tokens == drafts


def test_a_sampled_record_drafts_from_the_corpus_too():
    """Strict sampling's text is the positions' draws whatever is drafted, so a sampled
    record may draft from other records as a greedy one does (the engine keeps a corpus only
    under strict verification). It joins the corpus when it leaves."""
    corpus = JobCorpus(3)
    corpus.add([1, 2, 3, 4, 5, 6, 7])
    d = NgramDrafter(8, ngram_max=3, corpus=corpus)
    d.start([9, 2, 3], SamplingParams(temperature=0.8))
    assert d.offer([9, 2, 3, 4], 8).available == 3
    d.accepted(0, 0, [9, 2, 3, 4, 8])
    d.finish()
    assert corpus.records == 2


def test_corpus_matches_learn_their_own_acceptance():
    corpus = JobCorpus(2)
    corpus.add([1, 2, 3, 4])
    d = NgramDrafter(8, ngram_max=2, corpus=corpus)
    d.start([5, 1, 2])
    before_own = d._trackers[2].alpha
    before = d._corpus_trackers[2].alpha
    d.offer([5, 1, 2], 8)
    d.propose([5, 1, 2], 2)
    d.accepted(2, 0, [5, 1, 2, 9])  # both corpus drafts rejected
    assert d._corpus_trackers[2].alpha < before
    assert d._trackers[2].alpha == before_own


def test_old_records_leave_within_the_token_budget():
    corpus = JobCorpus(2, max_tokens=10)
    corpus.add([1, 2, 3, 4, 5, 6])
    corpus.add([1, 2, 9, 9])  # "1 2" now points here
    assert corpus.records == 2 and corpus.tokens == 10
    corpus.add([20, 21, 22])  # 13 tokens: the first record leaves
    assert corpus.records == 2 and corpus.tokens == 7
    assert corpus.lookup([3, 4], 1, 2) is None  # only the evicted record had "3 4"
    n, doc, pos = corpus.lookup([1, 2], 1, 2)
    assert (n, doc[pos:]) == (2, (9, 9))  # the newer record's entry survived the eviction
    corpus.clear()
    assert corpus.records == 0 and corpus.lookup([1, 2], 1, 2) is None


def test_a_record_joins_the_corpus_when_its_row_leaves():
    corpus = JobCorpus(2)
    rows = RowDrafters(lambda: NgramDrafter(4, ngram_max=2, corpus=corpus), corpus=corpus)
    rows.add_row([1, 2, 3], SamplingParams())
    rows.add_row([4, 5, 6], SamplingParams())
    rows.offers([[1, 2, 3], [4, 5, 6]], [4, 4])
    rows.accepted(0, 0, 0, [1, 2, 3, 10])
    rows.accepted(1, 0, 0, [4, 5, 6, 11])
    assert corpus.records == 0  # nothing yet: both rows are running
    rows.keep([1])  # row 0 finished
    assert corpus.records == 1 and corpus.lookup([2, 3], 1, 2)[1] == (1, 2, 3, 10)
    rows.reset()
    assert corpus.records == 2


def test_only_strict_verification_gets_a_corpus(target):
    assert make_engine(target, "ngram").drafters.corpus is not None
    assert make_engine(target, "ngram", verify=VerifyConfig("mars", 0.9)).drafters.corpus is None
    assert make_engine(target, "ngram", job_corpus=False).drafters.corpus is None
    off = DraftConfig(kind="ngram", num_draft_tokens=4, adaptive=False, job_corpus=False)  # --no-job-corpus
    assert build_engine(target, None, VerifyConfig(), off).drafters.corpus is None


def test_strict_output_is_unchanged_by_the_corpus(target, oracle):
    engine = make_engine(target, "ngram")
    texts = ["one two three four five six seven eight", "one two three four five six seven eight nine",
             "the cat sat on the mat", "the cat sat on the mat and"]
    drafted_from_corpus = False
    for text in texts:
        ids = target.tokenizer(text).input_ids
        before = engine.drafters.corpus.records
        res = engine.generate_ids(ids, SamplingParams(max_tokens=24))
        assert res.token_ids == hf_greedy(oracle, ids, 24), text
        assert engine.drafters.corpus.records == before + 1
        drafted_from_corpus |= res.stats.drafted > 0
    assert drafted_from_corpus
    engine.forget_earlier_records()
    assert engine.drafters.corpus.records == 0
