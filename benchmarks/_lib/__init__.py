"""What the benchmark scripts share: repository paths (:mod:`.paths`), random-init model shapes (:mod:`.shapes`),
device synchronisation and memory release (:mod:`.device`), tensor-level peak memory (:mod:`.memtrack`),
writing a result document (:mod:`.output`), starting a script's child phases (:mod:`.launch`) and verl_live's
torch-free run records (:mod:`.verl_records`)."""
