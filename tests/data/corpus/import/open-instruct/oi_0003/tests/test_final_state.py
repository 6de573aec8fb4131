def test_count():
    assert open("/workspace/count.txt").read().strip() == "2"
