"""fedweave_quickstart: a Flower App (Message API) on scikit-learn's digits."""
