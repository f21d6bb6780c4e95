"""Training EAGLE-3 heads from a target's own answers (`marscli train-head`):
corpus (prompts from what is on disk), collect (stage 1: answers and hidden states on disk),
ttt (the objective and the simulated acceptance length), train (stages 2 and 3)."""
