"""Training recipes: recipes/<family>/<name>.yaml (data) and, per model family, its model code."""
