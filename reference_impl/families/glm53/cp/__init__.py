"""GLM-5.3 under CP: the rank's store (:mod:`.store`) and the layer step (:mod:`.step`)."""
