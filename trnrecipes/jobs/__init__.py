"""The job dir: rendering the Slurm scripts from templates/ (render.py), the table of Neuron env vars and compiler
flags per stack that feeds every template (neuron_env.py), and what is checked before a job is written: its data
(data_check.py), where its checkpoints go (storage.py) and whether the other nodes see its files (mounts.py).

Torch-free, on the rendering path. Imports config/, plan/, trnrecipes.schema and (for the corpus check at render
time, when pyarrow is there) trnrecipes.data.arrow.
"""
