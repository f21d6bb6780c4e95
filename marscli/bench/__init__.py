"""What a benchmark is: methods and their spellings, settings, prompts, runs and how they add
up (``methods``), the metrics of an output against the reference method's and of speed
(``metrics``), forward timing and memory (``measure``), the protocol on loaded models: every
method's runner, warm-up, timed runs, throughput, the correctness check (``runner.Bench``),
and the report's JSON, tables and plot (``report``). marscli.jobs.bench runs a benchmark.
"""
