"""Shared pure tensor math: sparsity masks, damped Hessian factorisations, proximal operators."""
