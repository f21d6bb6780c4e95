"""Drafters: what proposes tokens. One small class per drafter behind the protocols the engine
calls (``base``: Drafter, BatchedDrafter, DraftOffer, the draft-length policy), made by
``factory`` from a DraftConfig: n-gram lookup with the job corpus (``ngram``), a draft model
(``model``), an EAGLE-3 head drafting chains and trees (``eagle3``, the head itself in
``eagle3_head``, its checkpoints on disk in ``eagle3_files``)."""
