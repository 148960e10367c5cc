
from tasc.hessian import HutchinsonEstimate
from tasc.hessian import PowerIterationResult
from tasc.hessian import hutchinson
from tasc.hessian import hutchinson_diagonal
from tasc.hessian import hutchinson_trace
from tasc.hessian import hvp
from tasc.hessian import top_eigenvalue
from tasc.compressor import TascState
from tasc.compressor import tasc_compressor
from tasc.scores import block_scores
from tasc.transform import density_for_budget
from tasc.transform import tasc_compress
