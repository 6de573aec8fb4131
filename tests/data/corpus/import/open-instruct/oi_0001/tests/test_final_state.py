def test_total():
    assert open("/workspace/total.txt").read().strip() == "6"
