"""The structure read of block 0 (``block0_roots``): every token's MLP input as a root of its span
problem, then the attention outputs, the images and positions."""
