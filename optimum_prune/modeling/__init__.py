"""Model-graph knowledge: which module plays which role per architecture, and the surgery that removes units."""
