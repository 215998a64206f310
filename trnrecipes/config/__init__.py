"""What a recipe is and whether it is valid: the typed sections (sections.py), loading, overrides and checks
(recipe.py), instances (cluster.py), Neuron stacks (stacks.py), model families (families.py), pipeline stage splits
(stages.py), the pre-timeout lead (preemption.py) and the allow_changes rules (changes.py).

Torch-free, on the rendering path. Imports only trnrecipes.schema, the family specs in recipes/<family>/spec.py and
itself.
"""
