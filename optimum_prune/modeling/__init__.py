"""Model-graph knowledge: the architecture table, target roles, physical surgery and the pruned auto classes."""
