def test_label():
    assert open("/home/user/label.txt").read().strip() == "3"
