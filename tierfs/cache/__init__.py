"""The cache: tiers (directories with a byte capacity), per-chunk residency, the eviction and
admission policy, and the staging area for fetched chunks no tier admitted."""
