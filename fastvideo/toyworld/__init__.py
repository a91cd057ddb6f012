"""Toy world: generated scenes of coloured shapes and a verifiable prompt-following reward, for testing RL of
text-to-image models on a CPU. ``scenes`` holds the world (grammar, split, renderer); ``verify`` scores an image
against its prompt by pixel analysis (colour, shape, count, relative position). Submodules import nothing heavy
beyond numpy and torch."""
