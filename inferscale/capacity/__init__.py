"""Capacity planning (``inferscale plan``): a fleet's storage, hit rates and fetch times, simulated with the
store's own cache policy (``store.blockcache``) and fetch planner (``store.fetchplan``)."""
