"""Task scores: HumanEval pass@1 by execution, GSM8K accuracy, ROUGE-L for summaries, and the
paired statistics that compare a lossy method with strict decoding on the same records.

- tasks.py: `score_items`, the one entry point (`marscli score` and `bench --task` call it),
  and the readers of result lines and prompt sets;
- humaneval.py: problems, code extraction, the child process that runs the tests;
- gsm8k.py: the final number of an answer;
- stats.py: mean CIs, the paired bootstrap, flips, recovery, `ends_in_loop`;
- compare.py: bench's comparison of every method with strict, and its table.

Nothing here imports torch.
"""
