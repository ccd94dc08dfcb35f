def test_import_needs_no_gpu():
    import moeforge
    assert moeforge.QuantTensor and moeforge.mul_mat_id and moeforge.mul_mat
