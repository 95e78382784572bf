"""Training the testbed backbones (`python -m lab.testbed.train`), their evaluation and model cards
(`python -m lab.testbed.evaluate`) and the tokenizer builder. The tasks they train on and the shipped demo
model stay in the product (slimwise.testbed); the other trained checkpoints live in
lab/testbed/checkpoints."""
