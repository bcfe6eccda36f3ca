# QuaRot area (rotations, simulated activation / KV-cache quantization, outlier planting, K-sort,
# BFP keys). Paths relative to worker/.
# H3: kv_quantizer, act_quant, rotate, quarot_model, checkpoint.
list(APPEND QCAL_WORKER_SOURCES
  quarot/kv_quantizer.cc quarot/act_quant.cc quarot/rotate.cc quarot/quarot_model.cc
  quarot/checkpoint.cc)
# H4: BFP keys, K-sort, outlier planting and statistics.
list(APPEND QCAL_WORKER_SOURCES
  quarot/bfp_kv.cc quarot/ksort.cc quarot/plant_outliers.cc quarot/outlier_stats.cc
  quarot/model_compare.cc)
